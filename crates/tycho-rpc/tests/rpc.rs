//! The RPC layer over real loopback TCP.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tycho_proto::auth::handshake::{self, Service as Protocol};
use tycho_proto::auth::{ClientAuth, Secret};
use tycho_proto::frame::{encode_frame, FrameError, FrameHeader, FrameKind, HEADER_LEN};
use tycho_rpc::{serve, ClientConfig, Reply, RpcClient, RpcError, RpcPool, ServerConfig, Service};

#[derive(Debug, Serialize, Deserialize)]
enum Req {
    Echo(u64),
    SleepMs(u64, u64),
    Blob(Vec<u8>),
    Fill(usize),
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum Resp {
    Echo(u64),
    Len(usize),
    Blob(Vec<u8>),
    Bad(String),
}

#[derive(Default)]
struct TestService {
    calls: AtomicU64,
}

impl Service for TestService {
    type Request = Req;
    type Response = Resp;
    fn call(&self, req: Req, _peer: &handshake::Peer) -> Reply<Resp> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match req {
            Req::Echo(n) => Reply::Ready(Resp::Echo(n)),
            Req::SleepMs(ms, n) => Reply::Later(Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Resp::Echo(n)
            })),
            Req::Blob(b) => Reply::Ready(Resp::Len(b.len())),
            Req::Fill(n) => Reply::Ready(Resp::Blob((0..n).map(|i| i as u8).collect())),
        }
    }
    fn malformed(&self, err: &FrameError) -> Resp {
        Resp::Bad(err.to_string())
    }
}

fn secret() -> Arc<Secret> {
    Arc::new(Secret::from_text(b"rpc-test-cluster-secret-of-enough-length").unwrap())
}

/// A client configuration holding the test cluster's secret.
fn cfg() -> ClientConfig {
    ClientConfig { auth: ClientAuth::Secret(secret()), ..ClientConfig::default() }
}

async fn start(max_frame: u32) -> (tycho_rpc::ServerHandle, Arc<TestService>, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let svc = Arc::new(TestService::default());
    let h =
        serve(listener, svc.clone(), ServerConfig { max_frame, secret: Some(secret()), ..Default::default() }).unwrap();
    let addr = h.local_addr().to_string();
    (h, svc, addr)
}

const T: Duration = Duration::from_secs(5);

#[tokio::test]
async fn many_calls_in_flight_on_one_connection_are_matched_by_id() {
    let (_h, _svc, addr) = start(1 << 20).await;
    let c = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..500u64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            // Every third call is slow, so answers come back out of order.
            let req = if i % 3 == 0 { Req::SleepMs(20 - (i % 20), i) } else { Req::Echo(i) };
            let r: Resp = c.call(&req, T).await.unwrap();
            assert_eq!(r, Resp::Echo(i));
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn slow_call_does_not_block_fast_calls_behind_it() {
    let (_h, _svc, addr) = start(1 << 20).await;
    let c = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let slow = {
        let c = c.clone();
        tokio::spawn(async move { c.call::<_, Resp>(&Req::SleepMs(2_000, 1), T).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Completes while the slow one is still outstanding.
    let fast: Resp = c.call(&Req::Echo(2), Duration::from_secs(1)).await.unwrap();
    assert_eq!(fast, Resp::Echo(2));
    assert!(!slow.is_finished());
    assert_eq!(slow.await.unwrap().unwrap(), Resp::Echo(1));
}

#[tokio::test]
async fn deadline_expires_and_connection_stays_usable() {
    let (_h, _svc, addr) = start(1 << 20).await;
    let c = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let err = c.call::<_, Resp>(&Req::SleepMs(500, 1), Duration::from_millis(50)).await.unwrap_err();
    assert!(matches!(err, RpcError::Timeout(_)), "{err:?}");
    assert_eq!(err.code(), tycho_proto::ErrorCode::RPC_TIMEOUT);
    let r: Resp = c.call(&Req::Echo(9), T).await.unwrap();
    assert_eq!(r, Resp::Echo(9));
}

#[tokio::test]
async fn silent_peer_times_out() {
    // A listener that accepts and never says a word: the greeting times out.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        let (mut first, _) = listener.accept().unwrap();
        let (mut second, _) = listener.accept().unwrap();
        // The second one greets (without a secret), then never answers a call.
        handshake::serve(&mut second, Protocol::Rpc, None).unwrap();
        let _ = wait.recv();
        drop((&mut first, second));
    });
    let quick = ClientConfig { connect_timeout: Duration::from_millis(200), auth: ClientAuth::Insecure, ..cfg() };
    let err = RpcClient::connect(&addr, &quick).await.err().expect("no greeting, no connection");
    assert!(matches!(err, RpcError::Handshake { .. }), "{err:?}");
    let c = RpcClient::connect(&addr, &quick).await.unwrap();
    let err = c.call::<_, Resp>(&Req::Echo(1), Duration::from_millis(100)).await.unwrap_err();
    assert!(matches!(err, RpcError::Timeout(_)));
    drop(done);
}

/// A connection proves the cluster secret before its first call: without it, or with
/// another cluster's, it is refused with a typed error naming what to set; a client of an
/// older frame version gets a greeting it reports as a version mismatch naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_the_secret_are_refused() {
    let (_h, svc, addr) = start(1 << 20).await;
    let none = ClientConfig { auth: ClientAuth::Insecure, ..cfg() };
    let err = RpcClient::connect(&addr, &none).await.err().expect("refused");
    assert_eq!(err.code(), tycho_proto::ErrorCode::AUTH_REQUIRED, "{err}");
    assert!(err.to_string().contains("TYCHO_SECRET_FILE"), "{err}");
    let other = Arc::new(Secret::from_text(b"another-cluster-secret-of-enough-length").unwrap());
    let wrong = ClientConfig { auth: ClientAuth::Secret(other), ..cfg() };
    let err = RpcClient::connect(&addr, &wrong).await.err().expect("refused");
    assert_eq!(err.code(), tycho_proto::ErrorCode::AUTH_FAILED, "{err}");
    let blocking = tycho_rpc::BlockingClient::new(&addr, none);
    let err =
        tokio::task::spawn_blocking(move || blocking.call::<_, Resp>(&Req::Echo(1), T).unwrap_err()).await.unwrap();
    assert_eq!(err.code(), tycho_proto::ErrorCode::AUTH_REQUIRED, "{err}");
    // An old client sends its request at once; the first header it reads carries this build's
    // version.
    let mut old = TcpStream::connect(&addr).await.unwrap();
    let mut frame = Vec::new();
    encode_frame(&mut frame, FrameKind::Request, 1, &Req::Echo(1)).unwrap();
    frame[2] = tycho_proto::frame::FRAME_VERSION - 1;
    old.write_all(&frame).await.unwrap();
    let mut head = [0u8; HEADER_LEN];
    old.read_exact(&mut head).await.unwrap();
    assert_eq!(FrameHeader::decode(&head, 1 << 20).unwrap().kind, FrameKind::Hello);
    assert_eq!(head[2], tycho_proto::frame::FRAME_VERSION, "an old decoder reports 'unsupported frame version N'");
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(T, old.read_to_end(&mut rest)).await.unwrap();
    assert_eq!(svc.calls.load(Ordering::Relaxed), 0, "no call ran");
}

#[tokio::test]
async fn dead_peer_fails_calls_and_pool_reconnects() {
    let (h, _svc, addr) = start(1 << 20).await;
    let pool = RpcPool::new(cfg());
    let c = pool.get(&addr).await.unwrap();
    let _: Resp = c.call(&Req::Echo(1), T).await.unwrap();
    h.shutdown().await;
    let err = c.call::<_, Resp>(&Req::Echo(2), T).await.unwrap_err();
    assert!(matches!(err, RpcError::Closed(_)), "{err:?}");
    assert!(c.is_closed());
    // Nothing listens now: connecting fails with a typed error.
    assert!(matches!(pool.get(&addr).await, Err(RpcError::Connect { .. })));
}

#[tokio::test]
async fn garbage_peer_is_disconnected_and_others_are_unaffected() {
    let (h, svc, addr) = start(1 << 20).await;
    let good = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let _: Resp = good.call(&Req::Echo(1), T).await.unwrap();

    let mut bad = TcpStream::connect(&addr).await.unwrap();
    bad.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    // The server greets, then closes the connection (a reset, as it leaves bytes unread).
    let mut greeting = [0u8; HEADER_LEN + handshake::SERVER_HELLO_LEN];
    bad.read_exact(&mut greeting).await.unwrap();
    let mut sink = Vec::new();
    match tokio::time::timeout(T, bad.read_to_end(&mut sink)).await.unwrap() {
        Ok(n) => assert_eq!(n, 0),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
    }

    let r: Resp = good.call(&Req::Echo(2), T).await.unwrap();
    assert_eq!(r, Resp::Echo(2));
    assert_eq!(svc.calls.load(Ordering::Relaxed), 2);
    // The count drops just after the socket closes; give the task a moment to finish.
    for _ in 0..100 {
        if h.open_connections() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.open_connections(), 1);
}

#[tokio::test]
async fn oversized_frame_closes_only_that_connection() {
    let (_h, _svc, addr) = start(4096).await;
    let good = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let big = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let err = big.call::<_, Resp>(&Req::Blob(vec![7; 10_000]), T).await.unwrap_err();
    assert!(matches!(err, RpcError::Closed(_)), "{err:?}");
    let ok: Resp = good.call(&Req::Blob(vec![7; 1000]), T).await.unwrap();
    assert_eq!(ok, Resp::Len(1000));
}

#[tokio::test]
async fn malformed_payload_gets_an_error_reply_and_connection_survives() {
    #[derive(Serialize)]
    enum Wrong {
        #[allow(dead_code)]
        A,
        B,
        C,
        D,
        E(String),
    }
    let _ = (Wrong::B, Wrong::C, Wrong::D);
    let (_h, _svc, addr) = start(1 << 20).await;
    let c = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let r: Resp = c.call(&Wrong::E("x".into()), T).await.unwrap();
    assert!(matches!(r, Resp::Bad(_)), "{r:?}");
    let r: Resp = c.call(&Req::Echo(3), T).await.unwrap();
    assert_eq!(r, Resp::Echo(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_client_calls_from_plain_threads() {
    let (_h, _svc, addr) = start(1 << 20).await;
    let client = Arc::new(tycho_rpc::BlockingClient::new(&addr, cfg()));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let client = client.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let r: Resp = client.call(&Req::Echo(t * 1000 + i), T).unwrap();
                    assert_eq!(r, Resp::Echo(t * 1000 + i));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // A slow call times out; the next call works on a fresh connection.
    let c2 = client.clone();
    let err = tokio::task::spawn_blocking(move || c2.call::<_, Resp>(&Req::SleepMs(500, 1), Duration::from_millis(50)))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, RpcError::Timeout(_)), "{err:?}");
    let c3 = client.clone();
    let r: Resp = tokio::task::spawn_blocking(move || c3.call(&Req::Echo(5), T)).await.unwrap().unwrap();
    assert_eq!(r, Resp::Echo(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_client_moves_frames_larger_than_socket_buffers_with_and_without_polling() {
    let (_h, _svc, addr) = start(64 << 20).await;
    for spin in [Duration::ZERO, tycho_rpc::DEFAULT_SPIN] {
        let cfg = ClientConfig { max_frame: 64 << 20, spin, ..cfg() };
        let client = tycho_rpc::BlockingClient::new(&addr, cfg);
        tokio::task::spawn_blocking(move || {
            let r: Resp = client.call(&Req::Blob(vec![7; 12 << 20]), T).unwrap();
            assert_eq!(r, Resp::Len(12 << 20));
            let Resp::Blob(b) = client.call(&Req::Fill(9 << 20), T).unwrap() else { panic!("wrong variant") };
            assert_eq!(b.len(), 9 << 20);
            assert!(b.iter().enumerate().all(|(i, &x)| x == i as u8));
            // The connection went back to the pool in a clean state.
            assert_eq!(client.call::<_, Resp>(&Req::Echo(9), T).unwrap(), Resp::Echo(9));
        })
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_client_refuses_oversized_and_garbage_answers() {
    // An answer above the client's frame limit is an error, not an allocation.
    let (_h, _svc, addr) = start(64 << 20).await;
    let small = tycho_rpc::BlockingClient::new(&addr, ClientConfig { max_frame: 1 << 20, ..cfg() });
    let err =
        tokio::task::spawn_blocking(move || small.call::<_, Resp>(&Req::Fill(2 << 20), T).unwrap_err()).await.unwrap();
    assert!(matches!(err, RpcError::Frame(_)), "{err:?}");
    // A peer that answers with garbage, or hangs up, gives an error rather than a panic.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for (i, conn) in listener.incoming().take(3).enumerate() {
            let mut conn = conn.unwrap();
            handshake::serve(&mut conn, Protocol::Rpc, None).unwrap();
            let mut buf = [0u8; 64];
            let n = conn.read(&mut buf).unwrap_or(0);
            match i {
                0 => {
                    let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
                }
                1 => {}
                _ => {
                    // A well-formed answer with bytes trailing it, in one write.
                    let head: &[u8; HEADER_LEN] = buf[..HEADER_LEN.min(n)].try_into().expect("a request header");
                    let id = FrameHeader::decode(head, 1 << 20).expect("request header").request_id;
                    let mut out = Vec::new();
                    encode_frame(&mut out, FrameKind::Response, id, &Resp::Echo(3)).unwrap();
                    out.extend_from_slice(b"trailing junk");
                    let _ = conn.write_all(&out);
                }
            }
        }
    });
    let client = tycho_rpc::BlockingClient::new(&addr, ClientConfig { auth: ClientAuth::Insecure, ..cfg() });
    tokio::task::spawn_blocking(move || {
        let garbage = client.call::<_, Resp>(&Req::Echo(1), T).unwrap_err();
        assert!(matches!(garbage, RpcError::Frame(_)), "{garbage:?}");
        let hangup = client.call::<_, Resp>(&Req::Echo(2), T).unwrap_err();
        assert!(matches!(hangup, RpcError::Closed(_)), "{hangup:?}");
        let trailing = client.call::<_, Resp>(&Req::Echo(3), T).unwrap_err();
        assert!(matches!(trailing, RpcError::Closed(_)), "{trailing:?}");
    })
    .await
    .unwrap();
}

/// Waits (bounded) until the service has taken `n` calls.
async fn taken(svc: &TestService, n: u64) {
    let deadline = tokio::time::Instant::now() + T;
    while svc.calls.load(Ordering::Relaxed) < n {
        assert!(tokio::time::Instant::now() < deadline, "the call never reached the service");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn shutdown_answers_the_calls_already_taken() {
    let (h, svc, addr) = start(1 << 20).await;
    let c = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let pending = {
        let c = c.clone();
        tokio::spawn(async move { c.call::<_, Resp>(&Req::SleepMs(300, 7), T).await })
    };
    taken(&svc, 1).await;
    h.shutdown().await;
    assert_eq!(pending.await.unwrap().unwrap(), Resp::Echo(7));
    // Nothing more is taken.
    assert!(c.call::<_, Resp>(&Req::Echo(1), Duration::from_millis(500)).await.is_err());
}

#[tokio::test]
async fn shutdown_waits_for_a_stuck_call_no_longer_than_its_grace() {
    let (h, svc, addr) = start(1 << 20).await;
    let c = RpcClient::connect(&addr, &cfg()).await.unwrap();
    let stuck = {
        let c = c.clone();
        tokio::spawn(async move { c.call::<_, Resp>(&Req::SleepMs(60_000, 1), Duration::from_secs(30)).await })
    };
    taken(&svc, 1).await;
    let started = std::time::Instant::now();
    h.shutdown().await;
    let took = started.elapsed();
    assert!(took < tycho_rpc::DRAIN_GRACE + Duration::from_secs(2), "shutdown took {took:?}");
    assert!(stuck.await.unwrap().is_err(), "the stuck call cannot have been answered");
}
