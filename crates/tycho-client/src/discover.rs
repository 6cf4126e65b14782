//! Finding the masters from the coordination store: a client given Mooncake's form of master
//! address, `etcd://host:2379[,host:2379...][/CLUSTER]`, reads the masters' registrations
//! (`/tycho/{cluster}/masters/`) once, through etcd's JSON gateway (`POST /v3/kv/range`), and
//! then talks to the masters alone: it follows a failover among them as with a list of
//! addresses, and learns routes from them. No etcd client library (nor protoc) is needed, and
//! no client holds a watch on etcd. Without `/CLUSTER`, the name comes from `TYCHO_CLUSTER_NAME`,
//! else it is `tycho` (the masters' default).
//!
//! `etcds://` names an etcd served over TLS (rustls): the client checks etcd's certificate
//! against the CA in `TYCHO_ETCD_CA_FILE`, and presents the certificate and key of
//! `TYCHO_ETCD_CERT_FILE` / `TYCHO_ETCD_KEY_FILE` when those are set. Either scheme logs in as
//! `TYCHO_ETCD_USER` with the password in `TYCHO_ETCD_PASSWORD_FILE` when both are set (etcd
//! with authentication on). The settings come from the environment so that every client reads
//! them alike: the Python store, `tycho node` and the CLI.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use tycho_proto::cluster::{masters_prefix, prefix_end, MasterRegistration, DEFAULT_CLUSTER};
use tycho_proto::ErrorCode;

/// The scheme of a master address that names the coordination store instead.
pub const ETCD_SCHEME: &str = "etcd://";

/// The scheme of a master address that names the coordination store, served over TLS.
pub const ETCDS_SCHEME: &str = "etcds://";

/// The CA certificate (PEM) that signed etcd's, for an `etcds://` address (required there).
pub const ETCD_CA_ENV: &str = "TYCHO_ETCD_CA_FILE";
/// The client certificate (PEM) to present to etcd over TLS, when etcd asks for one.
pub const ETCD_CERT_ENV: &str = "TYCHO_ETCD_CERT_FILE";
/// The client certificate's private key (PEM).
pub const ETCD_KEY_ENV: &str = "TYCHO_ETCD_KEY_FILE";
/// The etcd user to log in as, where etcd has authentication on.
pub const ETCD_USER_ENV: &str = "TYCHO_ETCD_USER";
/// The file holding that user's password (its first line).
pub const ETCD_PASSWORD_FILE_ENV: &str = "TYCHO_ETCD_PASSWORD_FILE";

/// The environment variable naming the cluster when the address does not.
pub const CLUSTER_ENV: &str = "TYCHO_CLUSTER_NAME";

/// How long one etcd endpoint may take to connect and answer.
const ENDPOINT_TIMEOUT: Duration = Duration::from_secs(3);

/// Largest answer read from etcd.
const MAX_ANSWER: u64 = 4 << 20;

/// An `etcd://` or `etcds://` master address, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdAddress {
    /// `host:port` of each etcd endpoint.
    pub endpoints: Vec<String>,
    /// The cluster's name.
    pub cluster: String,
    /// Whether etcd is reached over TLS (`etcds://`).
    pub tls: bool,
}

impl EtcdAddress {
    /// Parses `addr` if it has the `etcd://` or `etcds://` scheme (`None` otherwise).
    pub fn parse(addr: &str) -> Option<Result<EtcdAddress, String>> {
        let addr = addr.trim();
        let (rest, tls) = match addr.strip_prefix(ETCDS_SCHEME) {
            Some(rest) => (rest, true),
            None => (addr.strip_prefix(ETCD_SCHEME)?, false),
        };
        // The name follows the last '/', unless that is part of an endpoint (`http://h:p`).
        let (hosts, cluster) = match rest.rsplit_once('/') {
            Some((h, name)) if !name.contains(':') && !h.ends_with('/') => {
                (h, if name.is_empty() { cluster_from_env() } else { name.to_string() })
            }
            _ => (rest, cluster_from_env()),
        };
        let mut endpoints = Vec::new();
        let (own, other) = if tls { ("https://", "http://") } else { ("http://", "https://") };
        for e in hosts.split([',', ';']).map(str::trim).filter(|e| !e.is_empty()) {
            let e = e.strip_prefix(own).unwrap_or(e);
            if e.starts_with(other) || !e.contains(':') || e.contains('/') {
                let scheme =
                    if tls { "etcds:// takes TLS endpoints" } else { "etcd:// takes plain HTTP ones; etcds:// TLS" };
                return Some(Err(format!("etcd endpoint {e:?}: give host:port ({scheme})")));
            }
            endpoints.push(e.to_string());
        }
        if endpoints.is_empty() {
            return Some(Err(format!("{addr:?} names no etcd endpoint")));
        }
        if cluster.contains('/') {
            return Some(Err(format!("cluster name {cluster:?} may not contain '/'")));
        }
        Some(Ok(EtcdAddress { endpoints, cluster, tls }))
    }

    /// The addresses of the cluster's live masters, in the order they registered (the client
    /// then uses the first that serves). Asks each endpoint in turn until one answers.
    pub fn masters(&self) -> Result<Vec<String>, ErrorCode> {
        let access = Access::from_env(self.tls).map_err(|e| {
            tracing::error!(error = %e, "cannot reach etcd with these settings");
            ErrorCode::INVALID_PARAMS
        })?;
        if !self.tls && access.login.is_some() {
            tracing::warn!(
                "logging in to etcd over plain HTTP: the password crosses the network in the clear (use etcds://)"
            );
        }
        let prefix = masters_prefix(&self.cluster).into_bytes();
        let body =
            format!(r#"{{"key":"{}","range_end":"{}"}}"#, base64_encode(&prefix), base64_encode(&prefix_end(&prefix)));
        let mut last = String::new();
        for endpoint in &self.endpoints {
            let answer = access
                .token(endpoint)
                .and_then(|token| post(endpoint, &access, token.as_deref(), "/v3/kv/range", &body));
            match answer.and_then(|answer| registrations(&answer)) {
                Ok(mut regs) => {
                    if regs.is_empty() {
                        tracing::error!(cluster = %self.cluster, etcd = %endpoint, "no master is registered in this cluster");
                        return Err(ErrorCode::ETCD_KEY_NOT_EXIST);
                    }
                    regs.sort_by_key(|(created, _)| *created);
                    return Ok(regs.into_iter().map(|(_, r)| r.address).collect());
                }
                Err(e) => {
                    tracing::warn!(etcd = %endpoint, error = %e, "cannot read the masters from etcd");
                    last = e;
                }
            }
        }
        tracing::error!(cluster = %self.cluster, error = %last, "no etcd endpoint answered");
        Err(ErrorCode::ETCD_OPERATION_ERROR)
    }
}

fn cluster_from_env() -> String {
    std::env::var(CLUSTER_ENV).ok().filter(|n| !n.is_empty()).unwrap_or_else(|| DEFAULT_CLUSTER.to_string())
}

/// How a client reaches etcd: over TLS or not, logged in or not (from the environment).
struct Access {
    tls: Option<Arc<rustls::ClientConfig>>,
    login: Option<(String, String)>,
}

impl Access {
    fn from_env(tls: bool) -> Result<Access, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let tls = if tls {
            let ca = var(ETCD_CA_ENV).ok_or_else(|| format!("an etcds:// address needs {ETCD_CA_ENV}"))?;
            Some(Arc::new(tls_config(&ca, var(ETCD_CERT_ENV), var(ETCD_KEY_ENV))?))
        } else {
            None
        };
        let login = match (var(ETCD_USER_ENV), var(ETCD_PASSWORD_FILE_ENV)) {
            (Some(user), Some(file)) => {
                let text =
                    std::fs::read_to_string(&file).map_err(|e| format!("{ETCD_PASSWORD_FILE_ENV} {file}: {e}"))?;
                Some((user, text.lines().next().unwrap_or("").to_string()))
            }
            (None, None) => None,
            _ => return Err(format!("set both {ETCD_USER_ENV} and {ETCD_PASSWORD_FILE_ENV}, or neither")),
        };
        Ok(Access { tls, login })
    }

    /// A token from logging in at `endpoint`, when a user is set.
    fn token(&self, endpoint: &str) -> Result<Option<String>, String> {
        let Some((user, password)) = &self.login else { return Ok(None) };
        let body = serde_json::json!({ "name": user, "password": password }).to_string();
        let answer =
            post(endpoint, self, None, "/v3/auth/authenticate", &body).map_err(|e| format!("login as {user}: {e}"))?;
        let v: serde_json::Value = serde_json::from_slice(&answer).map_err(|e| format!("login answer: {e}"))?;
        let token = v.get("token").and_then(|t| t.as_str()).ok_or("the login answer has no token")?;
        // It goes into a header: nothing but visible ASCII.
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the login answer's token is not a header value".into());
        }
        Ok(Some(token.to_string()))
    }
}

/// TLS settings that trust the CA in file `ca` alone and present `cert` and `key` (both or
/// neither).
fn tls_config(ca: &str, cert: Option<String>, key: Option<String>) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{ETCD_CA_ENV} {ca}: {e}"))? {
        let c = c.map_err(|e| format!("{ETCD_CA_ENV} {ca}: {e}"))?;
        roots.add(c).map_err(|e| format!("{ETCD_CA_ENV} {ca}: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!("{ETCD_CA_ENV} {ca}: no certificate in it"));
    }
    // ring, as tycho-meta's etcd client (aws-lc-rs, rustls's other provider, needs cmake to
    // build); rustls deprecates it for its lack of post-quantum key exchange.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    match (cert, key) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(&cert)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("{ETCD_CERT_ENV} {cert}: {e}"))?;
            let key = PrivateKeyDer::from_pem_file(&key).map_err(|e| format!("{ETCD_KEY_ENV} {key}: {e}"))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| format!("the client certificate: {e}"))
        }
        (None, None) => Ok(builder.with_no_client_auth()),
        _ => Err(format!("set both {ETCD_CERT_ENV} and {ETCD_KEY_ENV}, or neither")),
    }
}

/// One HTTP/1.0 POST of a JSON body (over TLS when `access` says so, with `token` when logged
/// in); the answer's body.
fn post(endpoint: &str, access: &Access, token: Option<&str>, path: &str, body: &str) -> Result<Vec<u8>, String> {
    // The whole exchange, however slowly the other side trickles its answer.
    let deadline = std::time::Instant::now() + 2 * ENDPOINT_TIMEOUT;
    let mut s = connect(endpoint)?;
    s.set_read_timeout(Some(ENDPOINT_TIMEOUT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(ENDPOINT_TIMEOUT)).map_err(|e| e.to_string())?;
    let auth = token.map(|t| format!("Authorization: {t}\r\n")).unwrap_or_default();
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {endpoint}\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut answer = Vec::new();
    match &access.tls {
        None => {
            s.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
            read_answer(&mut s, &mut answer, deadline).map_err(|e| e.to_string())?;
        }
        Some(config) => {
            let host = endpoint.rsplit_once(':').map_or(endpoint, |(h, _)| h).trim_matches(['[', ']']);
            let name = rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| format!("{host:?} is not a name TLS can check: {e}"))?;
            let conn = rustls::ClientConnection::new(config.clone(), name).map_err(|e| e.to_string())?;
            let mut tls = rustls::StreamOwned::new(conn, s);
            let tls_error =
                |e: std::io::Error| match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
                    Some(why @ rustls::Error::InvalidCertificate(_)) => {
                        format!("TLS: {why} (is {ETCD_CA_ENV} the CA that signed etcd's certificate?)")
                    }
                    Some(why @ rustls::Error::AlertReceived(_)) => {
                        format!("TLS: {why} (did etcd refuse {ETCD_CERT_ENV} / {ETCD_KEY_ENV}?)")
                    }
                    Some(why) => format!("TLS: {why}"),
                    None => e.to_string(),
                };
            tls.write_all(request.as_bytes()).map_err(tls_error)?;
            match read_answer(&mut tls, &mut answer, deadline) {
                Ok(_) => {}
                // A server that closes without a TLS close_notify: the answer is checked below
                // (its status and JSON), so a cut one is refused there.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {}
                Err(e) => return Err(tls_error(e)),
            }
        }
    }
    let split = answer.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no HTTP header in the answer")?;
    let head = String::from_utf8_lossy(&answer[..split]).to_string();
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        let said = String::from_utf8_lossy(&answer[split + 4..]);
        let said: String = said.chars().take(200).collect();
        return Err(format!("etcd answered {}: {}", head.lines().next().unwrap_or(""), said.trim()));
    }
    let body = answer[split + 4..].to_vec();
    if head.to_ascii_lowercase().replace(' ', "").contains("transfer-encoding:chunked") {
        return unchunk(&body);
    }
    Ok(body)
}

/// A TCP connection to `endpoint`: each address its name resolves to in turn.
fn connect(endpoint: &str) -> Result<TcpStream, String> {
    let mut last = "the name resolves to no address".to_string();
    for addr in endpoint.to_socket_addrs().map_err(|e| e.to_string())? {
        match TcpStream::connect_timeout(&addr, ENDPOINT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("{addr}: {e}"),
        }
    }
    Err(last)
}

/// Reads `from` to its end, at most [`MAX_ANSWER`] bytes, by `deadline`.
fn read_answer(from: &mut impl Read, answer: &mut Vec<u8>, deadline: std::time::Instant) -> std::io::Result<()> {
    let mut buf = [0u8; 16 << 10];
    loop {
        if std::time::Instant::now() > deadline {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "etcd's answer took too long"));
        }
        let n = from.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        if answer.len() + n > MAX_ANSWER as usize {
            return Err(std::io::Error::other("etcd's answer is too large"));
        }
        answer.extend_from_slice(&buf[..n]);
    }
}

/// Joins the chunks of a chunked HTTP body.
fn unchunk(mut body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line = body.windows(2).position(|w| w == b"\r\n").ok_or("truncated chunk")?;
        let size_text = String::from_utf8_lossy(&body[..line]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        body = &body[line + 2..];
        if size == 0 {
            return Ok(out);
        }
        if size.checked_add(2).is_none_or(|end| body.len() < end) {
            return Err("truncated chunk".into());
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

/// The registrations in a range answer of etcd's JSON gateway, with their create revisions.
fn registrations(answer: &[u8]) -> Result<Vec<(u64, MasterRegistration)>, String> {
    let v: serde_json::Value = serde_json::from_slice(answer).map_err(|e| format!("not JSON: {e}"))?;
    let Some(kvs) = v.get("kvs") else { return Ok(Vec::new()) };
    let kvs = kvs.as_array().ok_or("kvs is not a list")?;
    let mut out = Vec::new();
    for kv in kvs {
        let value = kv.get("value").and_then(|v| v.as_str()).ok_or("a key without a value")?;
        let bytes = base64_decode(value).ok_or("a value that is not base64")?;
        // int64 fields come as strings in etcd's JSON.
        let created = kv.get("create_revision").and_then(|v| v.as_str()).and_then(|v| v.parse().ok()).unwrap_or(0);
        match MasterRegistration::decode(&bytes) {
            Ok(r) => out.push((created, r)),
            // A registration of a newer build: skip it rather than guess.
            Err(e) => tracing::warn!(error = %e, "skipping a master registration this build cannot read"),
        }
    }
    Ok(out)
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes() {
        let v = B64.iter().position(|&b| b == c)? as u32;
        acc = acc << 6 | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_with_and_without_a_cluster_name() {
        assert_eq!(EtcdAddress::parse("10.0.0.1:50051"), None);
        let a = EtcdAddress::parse("etcd://h1:2379,http://h2:2379/prod").unwrap().unwrap();
        assert_eq!(
            a,
            EtcdAddress { endpoints: vec!["h1:2379".into(), "h2:2379".into()], cluster: "prod".into(), tls: false }
        );
        let s = EtcdAddress::parse("etcds://h1:2379,https://h2:2379/prod").unwrap().unwrap();
        assert_eq!((s.endpoints.len(), s.tls), (2, true));
        assert!(EtcdAddress::parse("etcds://http://h:2379").unwrap().is_err());
        let b = EtcdAddress::parse("etcd://h1:2379").unwrap().unwrap();
        assert_eq!(b.endpoints, vec!["h1:2379".to_string()]);
        let c = EtcdAddress::parse("etcd://http://h1:2379/").unwrap().unwrap();
        assert_eq!(c.endpoints, vec!["h1:2379".to_string()]);
        let d = EtcdAddress::parse("etcd://http://h1:2379/x").unwrap().unwrap();
        assert_eq!((d.endpoints, d.cluster), (vec!["h1:2379".to_string()], "x".to_string()));
        assert!(EtcdAddress::parse("etcd://").unwrap().is_err());
        assert!(EtcdAddress::parse("etcd://https://h:2379").unwrap().is_err());
        assert!(EtcdAddress::parse("etcd://h1").unwrap().is_err());
    }

    #[test]
    fn base64_round_trips() {
        for len in 0..40 {
            let data: Vec<u8> = (0..len).map(|i| (i * 37 + 5) as u8).collect();
            assert_eq!(base64_decode(&base64_encode(&data)).unwrap(), data);
        }
        assert_eq!(base64_encode(b"/tycho/"), "L3R5Y2hvLw==");
        assert!(base64_decode("not base64!").is_none());
    }

    #[test]
    fn a_range_answer_yields_its_registrations() {
        let r = MasterRegistration {
            id: "a".into(),
            address: "h:1".into(),
            role: tycho_proto::cluster::Role::Primary,
            registered_at_ms: 3,
        };
        let answer = format!(
            r#"{{"header":{{}},"kvs":[{{"key":"eA==","create_revision":"12","value":"{}"}}],"count":"1"}}"#,
            base64_encode(&r.encode())
        );
        assert_eq!(registrations(answer.as_bytes()).unwrap(), vec![(12, r)]);
        assert_eq!(registrations(br#"{"header":{}}"#).unwrap(), vec![]);
        assert!(registrations(b"garbage").is_err());
        assert_eq!(unchunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(), b"abcde");
        assert!(unchunk(b"ffffffffffffffff\r\nabc").is_err());
        assert_eq!(prefix_end(b"ab"), b"ac");
    }
}
