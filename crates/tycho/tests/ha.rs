//! Issue 12 with real processes: masters in a cluster on a real etcd (started by the test on
//! free ports, stopped with it), a real node and real clients.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tycho_client::{Client, ClientAuth, ClientConfig, Protocol};
use tycho_testkit::EtcdServer;
use tycho_testkit::{MasterProc, NodeProc, TempDir};

const TYCHO: &str = env!("CARGO_BIN_EXE_tycho");

/// Bound on each role change the test waits for.
const ROLE_WAIT: Duration = Duration::from_secs(30);

/// One test at a time: each runs an etcd, two masters and a node, and a master whose lease
/// renewals starve on a loaded machine would leave its role.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn secret_file(dir: &Path) -> PathBuf {
    let p = dir.join("cluster.secret");
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&p).unwrap();
    f.write_all(b"ha-test-cluster-secret-of-enough-length").unwrap();
    p
}

fn client(master: &str, secret: &Path) -> Client {
    let mut cfg = ClientConfig::new(master);
    cfg.auth = ClientAuth::Secret(Arc::new(tycho_proto::auth::files::load(secret).unwrap()));
    cfg.segment_size = 0;
    cfg.protocol = Protocol::Tcp;
    Client::connect(cfg).unwrap()
}

fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

/// An etcd, a shared secret, and the flags of masters of one cluster on them.
struct Cluster {
    etcd: EtcdServer,
    _home: TempDir,
    secret: PathBuf,
    name: &'static str,
}

impl Cluster {
    fn new(name: &'static str) -> Cluster {
        let etcd = EtcdServer::start_new().expect("etcd starts (scripts/test installs it)");
        let home = TempDir::new("tycho-ha").unwrap();
        let secret = secret_file(home.path());
        Cluster { etcd, _home: home, secret, name }
    }

    /// Starts a master of the cluster and waits until it prints `role`.
    fn master(&self, role: &str) -> MasterProc {
        let endpoint = self.etcd.endpoint();
        let flags = [
            "--etcd-endpoints",
            endpoint.as_str(),
            "--cluster-name",
            self.name,
            "--ha-lease-ttl",
            "2",
            "--client-ttl",
            "60",
            "--secret-file",
            self.secret.to_str().unwrap(),
        ];
        let mut m = MasterProc::start(TYCHO, &flags);
        m.proc.wait_line(&format!("tycho master role: {role}"), ROLE_WAIT).unwrap_or_else(|e| panic!("{role}: {e}"));
        m
    }

    /// Waits (bounded) until `master`'s registration is gone from etcd.
    fn wait_unregistered(&self, master: &MasterProc) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let opts = tycho_meta::EtcdOptions::new([self.etcd.endpoint()]);
            let store = tycho_meta::EtcdStore::connect(opts).await.unwrap();
            let key = tycho_master::ownership::ClusterKeys::new(self.name).master(&master.rpc);
            let deadline = Instant::now() + ROLE_WAIT;
            while tycho_meta::MetaStore::get(&store, &key).await.unwrap().kv.is_some() {
                assert!(Instant::now() < deadline, "the registration of {} never ended", master.rpc);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }

    /// A node of 64 MB registered with `master`, and a client that can put there.
    fn node_and_writer(&self, master: &MasterProc) -> (NodeProc, Client) {
        let node =
            NodeProc::start_env(TYCHO, &master.rpc, "64MB", &["--secret-file", self.secret.to_str().unwrap()], &[]);
        let writer = client(&master.rpc, &self.secret);
        let deadline = Instant::now() + Duration::from_secs(20);
        while writer.put("probe", b"x", &Default::default()).is_err() {
            assert!(Instant::now() < deadline, "the node's segment never became usable");
            std::thread::sleep(Duration::from_millis(50));
        }
        (node, writer)
    }
}

const KEYS: usize = 40;

fn key(i: usize) -> String {
    format!("ha/{i}")
}

/// Size of the value of key `i`: 1,000 to about 40,000 bytes.
fn size(i: usize) -> usize {
    1000 + (i % KEYS) * 997
}

fn put_all(writer: &Client) {
    for i in 0..KEYS {
        writer.put(&key(i), &value(&key(i), size(i)), &Default::default()).unwrap();
    }
}

/// Every acknowledged object, with its bytes, through a new client of `master`.
fn check_all(master: &MasterProc, secret: &Path) {
    let reader = client(&master.rpc, secret);
    for i in 0..KEYS {
        assert_eq!(reader.get(&key(i)).unwrap(), value(&key(i), size(i)), "{}", key(i));
    }
}

/// The first master serves, the second follows its log; SIGKILL of the first under a steady
/// put load: the second takes over once the first's registration lease has run out (2 s here),
/// the writer and the node, given both addresses, move to it by themselves, puts resume, and
/// every acknowledged object is read back with its bytes.
#[test]
fn a_standby_takes_over_a_killed_primary_and_serves_everything_acknowledged() {
    let _one = serial();
    let c = Cluster::new("killed");
    let mut a = c.master("primary");
    let mut b = c.master("standby");
    let both = format!("{},{}", a.rpc, b.rpc);
    let node = NodeProc::start_env(TYCHO, &both, "64MB", &["--secret-file", c.secret.to_str().unwrap()], &[]);
    let writer = client(&both, &c.secret);
    let deadline = Instant::now() + Duration::from_secs(20);
    while writer.put("probe", b"x", &Default::default()).is_err() {
        assert!(Instant::now() < deadline, "the node's segment never became usable");
        std::thread::sleep(Duration::from_millis(50));
    }
    let acked = std::sync::Mutex::new(Vec::new());
    let stop = std::sync::atomic::AtomicBool::new(false);
    let count = || acked.lock().unwrap().len();
    let wait_for = |n: usize, what: &str| {
        let deadline = Instant::now() + ROLE_WAIT;
        while count() < n {
            assert!(Instant::now() < deadline, "{what}: {} puts acknowledged", count());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if writer.put(&key(i), &value(&key(i), size(i)), &Default::default()).is_ok() {
                    acked.lock().unwrap().push(i);
                }
                i += 1;
            }
        });
        wait_for(KEYS, "before the kill");
        let killed = Instant::now();
        a.proc.signal(libc::SIGKILL);
        b.proc.wait_line("tycho master role: primary", ROLE_WAIT).expect("the standby takes over");
        let took = killed.elapsed();
        println!("the standby served {took:?} after the primary was killed (lease TTL 2 s)");
        assert!(took < Duration::from_secs(2 + 8), "took {took:?}");
        let before = count();
        wait_for(before + KEYS, "after the takeover");
        println!("puts resumed through the new primary: {} acknowledged in all", count());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let reader = client(&both, &c.secret);
    let acked = acked.into_inner().unwrap();
    for &i in &acked {
        assert_eq!(reader.get(&key(i)).unwrap(), value(&key(i), size(i)), "{}", key(i));
    }
    drop(node);
}

/// SIGTERM: the primary gives up its registration, and its standby takes over at once rather
/// than after the lease's TTL.
#[test]
fn a_stopped_primary_hands_over_at_once() {
    let _one = serial();
    let c = Cluster::new("stopped");
    let mut a = c.master("primary");
    let mut b = c.master("standby");
    let (_node, writer) = c.node_and_writer(&a);
    put_all(&writer);
    let stopped = Instant::now();
    a.proc.signal(libc::SIGTERM);
    b.proc.wait_line("tycho master role: primary", ROLE_WAIT).expect("the standby takes over");
    let took = stopped.elapsed();
    println!("the standby served {took:?} after the primary was stopped");
    assert!(took < Duration::from_secs(2), "{took:?}: not sooner than the lease's TTL");
    check_all(&b, &c.secret);
}

/// No standby: a master started after the primary died replays the whole log, takes the group
/// and serves everything acknowledged.
#[test]
fn without_a_standby_a_later_master_restores_the_group_from_the_log() {
    let _one = serial();
    let c = Cluster::new("alone");
    let mut a = c.master("primary");
    let (_node, writer) = c.node_and_writer(&a);
    put_all(&writer);
    a.proc.signal(libc::SIGKILL);
    // Only once the dead primary's registration is gone: the new master then finds no live
    // master in the record and takes the group over from the log, never as a standby.
    c.wait_unregistered(&a);
    let started = Instant::now();
    let later = c.master("primary");
    println!("a new master served {:?} after it started", started.elapsed());
    check_all(&later, &c.secret);
}
