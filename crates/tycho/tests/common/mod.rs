//! Helpers shared by the real-process test files (each includes this module).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tycho_client::ClientAuth;
use tycho_proto::auth::Secret;
use tycho_proto::{ClientId, Request, Response};

/// A raw connection to the master at `addr` as a newly registered client of `tenant`: its id
/// and the connection, which greets with the client's identity and credential.
#[allow(dead_code)]
pub fn registered(addr: &str, secret: &Arc<Secret>, tenant: &str) -> (ClientId, tycho_rpc::BlockingClient) {
    let t = Duration::from_secs(10);
    let auth = ClientAuth::Secret(secret.clone());
    let plain =
        tycho_rpc::BlockingClient::new(addr, tycho_rpc::ClientConfig { auth: auth.clone(), ..Default::default() });
    let Response::Registered { client, credential } =
        plain.call::<Request, Response>(&Request::Register { tenant: tenant.into() }, t).unwrap()
    else {
        panic!("no registration")
    };
    let identity =
        tycho_proto::auth::handshake::Identity::Client { client: client.0, tenant: tenant.into(), credential };
    let cfg = tycho_rpc::ClientConfig { auth, identity: Some(identity), ..Default::default() };
    (client, tycho_rpc::BlockingClient::new(addr, cfg))
}

/// One test of a file at a time, for tests that each run an etcd and several masters: a master
/// whose lease renewals starve on a loaded machine would lose its roles.
#[allow(dead_code)]
pub fn serial() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The text of the secret [`secret_file`] writes.
#[allow(dead_code)]
pub const SECRET_TEXT: &str = "test-cluster-secret-of-enough-length";

/// A cluster secret file (mode 0600) in `dir`.
#[allow(dead_code)]
pub fn secret_file(dir: &Path) -> PathBuf {
    let p = dir.join("cluster.secret");
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&p).unwrap();
    f.write_all(SECRET_TEXT.as_bytes()).unwrap();
    p
}

/// The admin token of the secret whose text is `text` (what `tycho admin-token` prints): the
/// admin HTTP server's credential.
#[allow(dead_code)]
pub fn admin_token(text: &str) -> String {
    tycho_proto::auth::admin_http_token(&Secret::from_text(text.trim().as_bytes()).unwrap())
}

/// One HTTP/1.1 request to the admin server at `http`, with a bearer token when given: the
/// status (0 when nothing came back) and the body.
#[allow(dead_code)]
pub fn http_call(http: &str, method: &str, path: &str, bearer: Option<&str>, body: &str) -> (u16, String) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = bearer.map_or(String::new(), |b| format!("Authorization: Bearer {b}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        let out = String::from_utf8_lossy(&raw);
        return (out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0), String::new());
    };
    let head = String::from_utf8_lossy(&raw[..split]);
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = &raw[split + 4..];
    (status, String::from_utf8_lossy(&if chunked { dechunk(body) } else { body.to_vec() }).into_owned())
}

/// The body of a chunked HTTP/1.1 answer (a long page, such as etcd's `/metrics`, comes in
/// chunks whose size lines may fall in the middle of one of its lines).
#[allow(dead_code)]
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let line = String::from_utf8_lossy(&rest[..eol]);
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        let after = &rest[eol + 2..];
        body.extend_from_slice(&after[..size.min(after.len())]);
        if size == 0 || after.len() < size {
            break;
        }
        rest = after[size..].strip_prefix(b"\r\n").unwrap_or(&after[size..]);
    }
    body
}
