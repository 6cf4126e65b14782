//! Finding the masters from the coordination store: a client given Mooncake's form of master
//! address, `etcd://host:2379[,host:2379...][/CLUSTER]`, reads the masters' registrations
//! (`/tycho/{cluster}/masters/`) once, through etcd's JSON gateway (`POST /v3/kv/range`), and
//! then talks to the masters alone: it follows a failover among them as with a list of
//! addresses, and learns routes from them. No etcd client library (nor protoc) is needed, and
//! no client holds a watch on etcd. Without `/CLUSTER`, the name comes from `TYCHO_CLUSTER_NAME`,
//! else it is `tycho` (the masters' default). Plain HTTP only: etcd behind TLS is not supported
//! here.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use tycho_proto::cluster::{masters_prefix, prefix_end, MasterRegistration, DEFAULT_CLUSTER};
use tycho_proto::ErrorCode;

/// The scheme of a master address that names the coordination store instead.
pub const ETCD_SCHEME: &str = "etcd://";

/// The environment variable naming the cluster when the address does not.
pub const CLUSTER_ENV: &str = "TYCHO_CLUSTER_NAME";

/// How long one etcd endpoint may take to connect and answer.
const ENDPOINT_TIMEOUT: Duration = Duration::from_secs(3);

/// Largest answer read from etcd.
const MAX_ANSWER: u64 = 4 << 20;

/// An `etcd://` master address, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdAddress {
    /// `host:port` of each etcd endpoint.
    pub endpoints: Vec<String>,
    /// The cluster's name.
    pub cluster: String,
}

impl EtcdAddress {
    /// Parses `addr` if it has the `etcd://` scheme (`None` otherwise).
    pub fn parse(addr: &str) -> Option<Result<EtcdAddress, String>> {
        let rest = addr.trim().strip_prefix(ETCD_SCHEME)?;
        // The name follows the last '/', unless that is part of an endpoint (`http://h:p`).
        let (hosts, cluster) = match rest.rsplit_once('/') {
            Some((h, name)) if !name.contains(':') && !h.ends_with('/') => {
                (h, if name.is_empty() { cluster_from_env() } else { name.to_string() })
            }
            _ => (rest, cluster_from_env()),
        };
        let mut endpoints = Vec::new();
        for e in hosts.split([',', ';']).map(str::trim).filter(|e| !e.is_empty()) {
            let e = e.strip_prefix("http://").unwrap_or(e);
            if e.starts_with("https://") || !e.contains(':') || e.contains('/') {
                return Some(Err(format!("etcd endpoint {e:?}: give host:port (plain HTTP)")));
            }
            endpoints.push(e.to_string());
        }
        if endpoints.is_empty() {
            return Some(Err(format!("{addr:?} names no etcd endpoint")));
        }
        if cluster.contains('/') {
            return Some(Err(format!("cluster name {cluster:?} may not contain '/'")));
        }
        Some(Ok(EtcdAddress { endpoints, cluster }))
    }

    /// The addresses of the cluster's live masters, in the order they registered (the client
    /// then uses the first that serves). Asks each endpoint in turn until one answers.
    pub fn masters(&self) -> Result<Vec<String>, ErrorCode> {
        let prefix = masters_prefix(&self.cluster).into_bytes();
        let body =
            format!(r#"{{"key":"{}","range_end":"{}"}}"#, base64_encode(&prefix), base64_encode(&prefix_end(&prefix)));
        let mut last = String::new();
        for endpoint in &self.endpoints {
            match post(endpoint, "/v3/kv/range", &body).and_then(|answer| registrations(&answer)) {
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

/// One HTTP/1.0 POST of a JSON body; the answer's body.
fn post(endpoint: &str, path: &str, body: &str) -> Result<Vec<u8>, String> {
    let addr = endpoint
        .to_socket_addrs()
        .map_err(|e| e.to_string())?
        .next()
        .ok_or_else(|| "the name resolves to no address".to_string())?;
    let mut s = TcpStream::connect_timeout(&addr, ENDPOINT_TIMEOUT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(ENDPOINT_TIMEOUT)).map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(ENDPOINT_TIMEOUT)).map_err(|e| e.to_string())?;
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    s.take(MAX_ANSWER).read_to_end(&mut answer).map_err(|e| e.to_string())?;
    let split = answer.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no HTTP header in the answer")?;
    let head = String::from_utf8_lossy(&answer[..split]).to_string();
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        return Err(format!("etcd answered {}", head.lines().next().unwrap_or("")));
    }
    let body = answer[split + 4..].to_vec();
    if head.to_ascii_lowercase().replace(' ', "").contains("transfer-encoding:chunked") {
        return unchunk(&body);
    }
    Ok(body)
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
        assert_eq!(a, EtcdAddress { endpoints: vec!["h1:2379".into(), "h2:2379".into()], cluster: "prod".into() });
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
