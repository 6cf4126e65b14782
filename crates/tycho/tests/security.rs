//! Issue 11 with real processes: who gets in, and what a peer may touch. Each attack runs
//! twice where it applies — without the cluster secret, and authenticated but without a grant —
//! and must be refused with a typed error and change nothing.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

use tycho_client::{Client, ClientAuth, ClientConfig, Protocol};
use tycho_proto::auth::capability::{Capability, RIGHT_READ};
use tycho_proto::auth::Secret;
use tycho_proto::*;
use tycho_testkit::{MasterProc, NodeProc, TempDir};
use tycho_transfer::{SegmentRegistry, TransferEngine};

const TYCHO: &str = env!("CARGO_BIN_EXE_tycho");

/// Runs `tycho <args> --master <master>` with `env` and `input` on standard input.
fn tycho(master: &str, args: &[&str], env: &[(&str, &str)], input: &[u8]) -> Output {
    let mut child = Command::new(TYCHO)
        .args(args)
        .args(["--master", master])
        .env_remove("TYCHO_SECRET_FILE")
        .env_remove("TYCHO_SECRET")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tycho");
    child.stdin.take().expect("piped").write_all(input).expect("write stdin");
    child.wait_with_output().expect("tycho runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Writes a secret file of mode 0600 in `dir`.
fn secret_file(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("cluster.secret");
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&p).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    p
}

#[test]
fn a_master_creates_its_secret_and_only_processes_holding_it_get_in() {
    let home = TempDir::new("tycho-sec-home").unwrap();
    let runtime = home.path().join("run");
    let elsewhere = home.path().join("elsewhere");
    let run = runtime.to_str().unwrap();
    let m = MasterProc::start_env(TYCHO, 0, &[], &[("TYCHO_RUNTIME_DIR", run)]);
    let file = runtime.join(format!("master-{}.secret", m.port()));
    let mode = std::fs::metadata(&file).expect("the master created its secret file").permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(std::fs::metadata(&runtime).unwrap().permissions().mode() & 0o777, 0o700);
    // A node and a client of the same user on the same host find it by themselves.
    let _node = NodeProc::start_env(TYCHO, &m.rpc, "16MB", &[], &[("TYCHO_RUNTIME_DIR", run)]);
    let put = tycho(&m.rpc, &["put", "k", "-"], &[("TYCHO_RUNTIME_DIR", run)], b"secret bytes");
    assert!(put.status.success(), "{}", text(&put.stderr));
    // Without it: refused, with a message that says what to set.
    let other = elsewhere.to_str().unwrap();
    let denied = tycho(&m.rpc, &["get", "k"], &[("TYCHO_RUNTIME_DIR", other)], b"");
    assert_eq!(denied.status.code(), Some(1));
    let err = text(&denied.stderr);
    assert!(err.contains("AUTH_REQUIRED") && err.contains("TYCHO_SECRET_FILE"), "{err}");
    assert!(text(&denied.stdout).is_empty());
    // Another cluster's secret: refused.
    let wrong = tycho(
        &m.rpc,
        &["get", "k"],
        &[("TYCHO_RUNTIME_DIR", other), ("TYCHO_SECRET", "some-other-cluster-secret")],
        b"",
    );
    assert!(text(&wrong.stderr).contains("AUTH_FAILED"), "{}", text(&wrong.stderr));
    // Given the file, from anywhere: in.
    let path = file.to_str().unwrap();
    let got = tycho(&m.rpc, &["get", "k"], &[("TYCHO_RUNTIME_DIR", other), ("TYCHO_SECRET_FILE", path)], b"");
    assert!(got.status.success(), "{}", text(&got.stderr));
    assert_eq!(got.stdout, b"secret bytes");
    // A copy others may read is refused rather than trusted.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let loose = tycho(&m.rpc, &["get", "k"], &[("TYCHO_RUNTIME_DIR", other), ("TYCHO_SECRET_FILE", path)], b"");
    assert!(!loose.status.success());
    assert!(text(&loose.stderr).contains("other users may read it"), "{}", text(&loose.stderr));
}

/// A raw transfer peer that knows a replica's segment, offset and length (all public) cannot
/// read or overwrite it: without the secret its connection is refused; with it, every request
/// without the master's grant for that range and right is refused. The object is intact.
#[test]
fn transfers_without_a_grant_are_refused_and_change_nothing() {
    let home = TempDir::new("tycho-sec-xfer").unwrap();
    let file = secret_file(home.path(), "transfer-attack-cluster-secret");
    let f = file.to_str().unwrap();
    let m = MasterProc::start(TYCHO, &["--secret-file", f]);
    let _node = NodeProc::start_env(TYCHO, &m.rpc, "16MB", &["--secret-file", f], &[]);
    let secret = Arc::new(tycho_proto::auth::files::load(&file).unwrap());
    let mut cfg = ClientConfig::new(&m.rpc);
    cfg.auth = ClientAuth::Secret(secret.clone());
    cfg.protocol = Protocol::Tcp;
    let victim = Client::connect(cfg).unwrap();
    let value: Vec<u8> = (0..8192u32).map(|i| (i * 13) as u8).collect();
    victim.put("victim", &value, &Default::default()).unwrap();
    let q = KeyQuery {
        tenant: String::new(),
        key: KeyRef { key: "victim".into(), route: tycho_routing::route_for("", "victim", 1) },
    };
    let Response::Replicas(list) = victim.call(&Request::GetReplicaList(q)).unwrap() else { panic!() };
    let r = list.replicas[0].clone();
    assert_eq!(r.cap.rights, RIGHT_READ);
    let mut out = vec![0u8; r.len as usize];

    // Without the secret.
    let outsider = TransferEngine::new("attacker", true, Arc::new(SegmentRegistry::default()), None);
    assert_eq!(outsider.read(&r, 0, &mut out).unwrap_err().code(), ErrorCode::AUTH_REQUIRED);
    assert_eq!(outsider.write(&r, 0, &[0xaa; 64]).unwrap_err().code(), ErrorCode::AUTH_REQUIRED);
    let impostor = Arc::new(Secret::from_text(b"a-guessed-cluster-secret").unwrap());
    let guess = TransferEngine::new("attacker", true, Arc::new(SegmentRegistry::default()), Some(impostor));
    assert_eq!(guess.read(&r, 0, &mut out).unwrap_err().code(), ErrorCode::AUTH_FAILED);

    // Authenticated, without a grant for what it does.
    let member = TransferEngine::new("attacker", true, Arc::new(SegmentRegistry::default()), Some(secret));
    let no_grant = ReplicaDesc { cap: Capability::default(), ..r.clone() };
    assert_eq!(member.read(&no_grant, 0, &mut out).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    // The read grant does not write, retire, or reach past the object.
    assert_eq!(member.write(&r, 0, &[0xaa; 64]).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    assert_eq!(member.retire(&r).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    let wider = ReplicaDesc { offset: r.offset.saturating_sub(4096), len: r.len + 8192, ..r.clone() };
    let mut big = vec![0u8; wider.len as usize];
    assert_eq!(member.read(&wider, 0, &mut big).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    let forged = ReplicaDesc { cap: Capability { rights: 3, ..r.cap }, ..r.clone() };
    assert_eq!(member.write(&forged, 0, &[0xaa; 64]).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    // With the grant, reading works: the refusals above were about the grant, not the path.
    member.read(&r, 0, &mut out).unwrap();
    assert_eq!(out, value);
    // Nothing changed.
    assert_eq!(victim.get("victim").unwrap(), value);
}

/// The master refuses connections without the secret before any request: unmount, forced
/// RemoveAll, spoofed pings never reach it, and nothing changes.
#[test]
fn master_calls_without_the_secret_never_run() {
    let home = TempDir::new("tycho-sec-rpc").unwrap();
    let file = secret_file(home.path(), "rpc-attack-cluster-secret");
    let f = file.to_str().unwrap();
    let m = MasterProc::start(TYCHO, &["--secret-file", f]);
    let _node = NodeProc::start_env(TYCHO, &m.rpc, "16MB", &["--secret-file", f], &[]);
    let secret = Arc::new(tycho_proto::auth::files::load(&file).unwrap());
    let mut cfg = ClientConfig::new(&m.rpc);
    cfg.auth = ClientAuth::Secret(secret);
    let owner = Client::connect(cfg).unwrap();
    owner.put("kept", b"value", &Default::default()).unwrap();
    let Response::Segments(segs) = owner.call(&Request::ListSegments).unwrap() else { panic!() };
    let before = segs.len();
    let attacks = [
        Request::UnmountSegment { client: segs[0].client, segment: segs[0].desc.id },
        Request::RemoveAll { force: true },
        Request::Ping { client: segs[0].client },
    ];
    for secret in [None, Some("not-the-cluster-secret")] {
        let auth = match secret {
            None => ClientAuth::Insecure,
            Some(t) => ClientAuth::Secret(Arc::new(Secret::from_text(t.as_bytes()).unwrap())),
        };
        let rpc = tycho_rpc::BlockingClient::new(&m.rpc, tycho_rpc::ClientConfig { auth, ..Default::default() });
        for a in &attacks {
            let err = rpc.call::<Request, Response>(a, std::time::Duration::from_secs(5)).unwrap_err();
            let want = if secret.is_none() { ErrorCode::AUTH_REQUIRED } else { ErrorCode::AUTH_FAILED };
            assert_eq!(err.code(), want, "{a:?}: {err}");
        }
    }
    let Response::Segments(segs) = owner.call(&Request::ListSegments).unwrap() else { panic!() };
    assert_eq!(segs.len(), before);
    assert_eq!(owner.get("kept").unwrap(), b"value");
}

/// A client on the node's host maps the node's segment through the node's local socket (the
/// memfd passed over it, no path from the master), reads and writes with one copy, and a
/// client that cannot reach the socket still gets the same bytes over TCP.
#[test]
fn same_host_clients_map_the_segment_through_the_local_socket() {
    let home = TempDir::new("tycho-sec-local").unwrap();
    let file = secret_file(home.path(), "local-mapping-cluster-secret");
    let f = file.to_str().unwrap();
    let m = MasterProc::start(TYCHO, &["--secret-file", f]);
    let _node = NodeProc::start_env(TYCHO, &m.rpc, "16MB", &["--secret-file", f], &[]);
    let secret = Arc::new(tycho_proto::auth::files::load(&file).unwrap());
    let mut cfg = ClientConfig::new(&m.rpc);
    cfg.auth = ClientAuth::Secret(secret);
    let c = Client::connect(cfg).unwrap();
    let value: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    c.put("local", &value, &Default::default()).unwrap();
    assert_eq!(c.peer_mappings(), 1, "the write mapped the node's segment");
    assert_eq!(c.get("local").unwrap(), value);
    assert_eq!(c.peer_mappings(), 1);
}
