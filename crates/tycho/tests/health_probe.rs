//! Spec 02 end to end: a real master built with failpoints, its admin HTTP and its self-probe.
//! Run with `cargo test -p tycho --features failpoints --test health_probe`.
#![cfg(feature = "failpoints")]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tycho_proto::*;
use tycho_rpc::{BlockingClient, ClientConfig};
use tycho_testkit::MasterProc;

fn start(extra: &[&str]) -> MasterProc {
    let mut args = vec!["--rpc-probe-interval", "0.3", "--rpc-probe-timeout", "0.5"];
    args.extend_from_slice(extra);
    let m = MasterProc::start(env!("CARGO_BIN_EXE_tycho"), &args);
    wait_until("the master to be ready", Duration::from_secs(20), || http(&m.http, "GET", "/readyz", "").0 == 200);
    m
}

/// A minimal HTTP/1.1 exchange; returns the status and the body.
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    http_as(addr, method, path, body, None)
}

/// [`http`] with `Authorization: Bearer <secret>` when a secret is given.
fn http_as(addr: &str, method: &str, path: &str, body: &str, secret: Option<&str>) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else { return (0, String::new()) };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let auth = secret.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn scrape(addr: &str) -> prometheus_parse::Scrape {
    let (status, body) = http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string()))).expect("valid Prometheus text")
}

fn value(s: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
    let sample = s
        .samples
        .iter()
        .find(|x| x.metric == name && label.is_none_or(|(k, v)| x.labels.get(k) == Some(v)))
        .unwrap_or_else(|| panic!("no sample {name} {label:?}"));
    match sample.value {
        prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Untyped(v) => v,
        _ => panic!("{name} is not a scalar"),
    }
}

#[test]
fn held_shard_lock_turns_readyz_503_while_liveness_still_answers() {
    let m = start(&[]);
    assert_eq!(value(&scrape(&m.http), "tycho_master_rpc_responsive", None), 1.0);
    // Hold shard 0's write lock for 4 s: far longer than probe interval + timeout (0.8 s).
    assert_eq!(http(&m.http, "PUT", "/fail/master::hold_shard_write", "1*return(4000)").0, 200);
    wait_until("/readyz to report 503", Duration::from_secs(4), || http(&m.http, "GET", "/readyz", "").0 == 503);
    let s = scrape(&m.http);
    assert_eq!(value(&s, "tycho_master_rpc_responsive", None), 0.0);
    assert!(value(&s, "tycho_master_rpc_probe_failures_total", None) >= 1.0);
    // Liveness, Ping and ServiceReady take no shard lock and still answer at once.
    assert_eq!(http(&m.http, "GET", "/livez", "").0, 200);
    assert_eq!(http(&m.http, "GET", "/health", "").0, 200);
    let rpc = BlockingClient::new(&m.rpc, ClientConfig::admin(&m.rpc).unwrap());
    let quick = Duration::from_millis(500);
    let ping: Response = rpc.call(&Request::Ping { client: ClientId(1) }, quick).unwrap();
    assert!(matches!(ping, Response::Ping(_)));
    assert_eq!(rpc.call::<_, Response>(&Request::ServiceReady, quick).unwrap(), Response::ServiceReady(true));
    // Still blocked: the next verdict is not ready either.
    assert_eq!(http(&m.http, "GET", "/readyz", "").0, 503);
    // Released: ready again.
    wait_until("/readyz to recover", Duration::from_secs(8), || http(&m.http, "GET", "/readyz", "").0 == 200);
    assert_eq!(value(&scrape(&m.http), "tycho_master_rpc_responsive", None), 1.0);
}

#[test]
fn exhausted_rpc_workers_turn_readyz_503() {
    let m = start(&["--rpc-thread-num", "2"]);
    // The next two calls put both RPC workers to sleep for 4 s.
    assert_eq!(http(&m.http, "PUT", "/fail/master::rpc::stall", "2*sleep(4000)").0, 200);
    let stallers: Vec<_> = (0..2)
        .map(|_| {
            let addr = m.rpc.clone();
            std::thread::spawn(move || {
                let c = BlockingClient::new(&addr, ClientConfig::admin(&addr).unwrap());
                let _ = c.call::<_, Response>(&Request::Stats, Duration::from_secs(10));
            })
        })
        .collect();
    wait_until("/readyz to report 503", Duration::from_secs(4), || http(&m.http, "GET", "/readyz", "").0 == 503);
    assert_eq!(value(&scrape(&m.http), "tycho_master_rpc_responsive", None), 0.0);
    assert_eq!(http(&m.http, "GET", "/livez", "").0, 200);
    for t in stallers {
        t.join().unwrap();
    }
    wait_until("/readyz to recover", Duration::from_secs(8), || http(&m.http, "GET", "/readyz", "").0 == 200);
}

#[test]
fn metrics_parse_and_counters_move_with_rpcs() {
    let m = start(&[]);
    let before = scrape(&m.http);
    let put = |s: &prometheus_parse::Scrape| value(s, "tycho_master_rpc_requests_total", Some(("rpc", "put_start")));
    let fails = |s: &prometheus_parse::Scrape| value(s, "tycho_master_rpc_failures_total", Some(("rpc", "put_start")));
    assert_eq!(put(&before), 0.0);
    let rpc = BlockingClient::new(&m.rpc, ClientConfig::admin(&m.rpc).unwrap());
    let t = Duration::from_secs(5);
    let client = ClientId(7);
    let seg = SegmentDesc {
        id: SegmentId(1),
        name: "seg-a".into(),
        base: 0,
        size: 1 << 20,
        endpoint: "127.0.0.1:1".into(),
        host: "h".into(),
        incarnation: 1,
    };
    assert_eq!(rpc.call::<_, Response>(&Request::MountSegment { client, segment: seg }, t).unwrap(), Response::Done);
    for i in 0..5 {
        let key = format!("k{i}");
        let kr = KeyRef { key: key.clone(), route: tycho_routing::route_for("", &key, 1) };
        let start = WriteStart {
            client,
            tenant: String::new(),
            key: kr.clone(),
            size: 100,
            config: Default::default(),
            write_id: i + 1,
        };
        assert!(matches!(rpc.call::<_, Response>(&Request::PutStart(start), t).unwrap(), Response::WriteStarted(_)));
        let end = WriteFinish { client, tenant: String::new(), key: kr.clone(), write_id: i + 1 };
        assert_eq!(rpc.call::<_, Response>(&Request::PutEnd(end), t).unwrap(), Response::Committed(vec![]));
        let q = KeyQuery { tenant: String::new(), key: kr };
        assert!(matches!(rpc.call::<_, Response>(&Request::GetReplicaList(q), t).unwrap(), Response::Replicas(_)));
    }
    // One failing call: a zero-size put.
    let kr = KeyRef { key: "z".into(), route: tycho_routing::route_for("", "z", 1) };
    let bad = WriteStart { client, tenant: String::new(), key: kr, size: 0, config: Default::default(), write_id: 99 };
    assert_eq!(
        rpc.call::<_, Response>(&Request::PutStart(bad), t).unwrap(),
        Response::Error(ErrorCode::INVALID_PARAMS)
    );
    // A batch that answers, with one of its three keys missing: a per-key failure only.
    let keys = ["k0", "missing", "k1"]
        .iter()
        .map(|k| KeyRef { key: k.to_string(), route: tycho_routing::route_for("", k, 1) })
        .collect();
    let batch =
        rpc.call::<_, Response>(&Request::BatchGetReplicaList(BatchKeyQuery { tenant: String::new(), keys }), t);
    assert!(matches!(batch.unwrap(), Response::BatchReplicas(r) if r.iter().filter(|x| x.is_err()).count() == 1));
    // The admin key lookup goes straight to the key's shard; it needs the master's secret.
    let file = tycho_proto::auth::files::runtime_dir().join(tycho_proto::auth::files::port_name(m.port()));
    let text = std::fs::read_to_string(file).expect("the master's secret file");
    let token =
        tycho_proto::auth::admin_http_token(&tycho_proto::auth::Secret::from_text(text.trim().as_bytes()).unwrap());
    let secret = Some(token.as_str());
    assert_eq!(http(&m.http, "GET", "/query_key?key=k0", "").0, 401);
    let (status, body) = http_as(&m.http, "GET", "/query_key?key=k0", "", secret);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"key\":\"k0\"") && body.contains("\"size\":100"), "{body}");
    assert_eq!(http_as(&m.http, "GET", "/query_key?key=missing", "", secret).0, 404);
    assert_eq!(http_as(&m.http, "GET", "/query_key?key=", "", secret).0, 400);
    let after = scrape(&m.http);
    let batch_rpc = Some(("rpc", "batch_get_replica_list"));
    assert_eq!(value(&after, "tycho_master_rpc_failures_total", batch_rpc), 0.0);
    assert_eq!(value(&after, "tycho_master_rpc_failed_items_total", batch_rpc), 1.0);
    assert_eq!(put(&after), 6.0);
    assert_eq!(fails(&after) - fails(&before), 1.0);
    assert_eq!(value(&after, "tycho_master_rpc_requests_total", Some(("rpc", "get_replica_list"))), 5.0);
    assert_eq!(value(&after, "tycho_master_keys", None), 5.0);
    assert_eq!(value(&after, "tycho_master_leased_objects", None), 5.0);
    assert_eq!(value(&after, "tycho_master_segments", None), 1.0);
    assert_eq!(value(&after, "tycho_master_capacity_bytes", None), (1u64 << 20) as f64);
    assert!(value(&after, "tycho_master_allocated_bytes", None) >= 500.0);
    assert_eq!(value(&after, "tycho_master_segment_capacity_bytes", Some(("segment", "seg-a"))), (1u64 << 20) as f64);
    assert_eq!(value(&after, "tycho_master_active_clients", None), 1.0);
    // Lookups by answer: five single gets and the batch's two found keys, its one missing; no
    // existence check. The policy keeps 8 bytes per object and 16 per group.
    let lookups = |op: &str, result: &str| {
        after
            .samples
            .iter()
            .find(|x| {
                x.metric == "tycho_master_lookups_total"
                    && x.labels.get("op") == Some(op)
                    && x.labels.get("result") == Some(result)
            })
            .map(|x| match x.value {
                prometheus_parse::Value::Counter(v) => v,
                ref other => panic!("not a counter: {other:?}"),
            })
            .unwrap_or_else(|| panic!("no lookups sample for {op} {result}"))
    };
    assert_eq!((lookups("get", "hit"), lookups("get", "miss")), (7.0, 1.0));
    assert_eq!((lookups("exist", "hit"), lookups("exist", "miss")), (0.0, 0.0));
    assert_eq!(value(&after, "tycho_master_eviction_policy_bytes", None), (5 * 8 + 16) as f64);
    assert_eq!(value(&after, "tycho_master_eviction_lifetime_uses", Some(("group", "0"))), 0.0);
    // The latency histogram counted every put_start.
    let hist = after
        .samples
        .iter()
        .find(|x| x.metric == "tycho_master_rpc_duration_seconds" && x.labels.get("rpc") == Some("put_start"))
        .expect("histogram");
    match &hist.value {
        prometheus_parse::Value::Histogram(buckets) => {
            assert_eq!(buckets.last().map(|b| b.count), Some(6.0));
        }
        other => panic!("not a histogram: {other:?}"),
    }
}

#[test]
fn readyz_without_the_probe_follows_serving_only() {
    let m = start(&["--enable-rpc-health-probe", "false"]);
    assert_eq!(value(&scrape(&m.http), "tycho_master_rpc_probes_total", None), 0.0);
    assert_eq!(http(&m.http, "GET", "/readyz", "").0, 200);
}
