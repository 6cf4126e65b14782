//! One real `etcd` member on loopback, owned by a test.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::TempDir;

/// How to start etcd.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// The binary; `None` looks in `$TYCHO_ETCD_BIN`, then `etcd` on `PATH`, then `/usr/bin/etcd`.
    pub binary: Option<PathBuf>,
    /// How long to wait for `/health` to report healthy after a start.
    pub startup_timeout: Duration,
    /// Extra command-line flags, for example `--max-txn-ops=16`.
    pub extra_args: Vec<String>,
    /// Also serve clients over TLS on a port of its own, asking for a client certificate signed
    /// by the same CA ([`EtcdServer::tls_endpoint`]); the plain listener stays, for the test.
    pub tls: Option<TestPki>,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig { binary: None, startup_timeout: Duration::from_secs(20), extra_args: Vec::new(), tls: None }
    }
}

/// Certificates for a TLS test, made with the `openssl` command in a directory of the test's:
/// a CA, a server certificate for 127.0.0.1 and a client certificate (CN `root`), each with
/// its key, as PEM files.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA's certificate.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub server: (PathBuf, PathBuf),
    /// The client's certificate and key.
    pub client: (PathBuf, PathBuf),
    /// A client certificate and key without a CommonName: what a client of etcd's JSON gateway
    /// presents where authentication is on (etcd refuses one with a CommonName there, since
    /// the gateway cannot log in by it).
    pub gateway_client: (PathBuf, PathBuf),
}

impl TestPki {
    /// Makes a CA named `name` and the two certificates it signs, in `dir`.
    pub fn generate(dir: &Path, name: &str) -> std::io::Result<TestPki> {
        let path = |f: &str| dir.join(format!("{name}-{f}"));
        let run = |args: &[&str]| -> std::io::Result<()> {
            let out = Command::new("openssl").args(args).stdin(Stdio::null()).output()?;
            if !out.status.success() {
                return Err(std::io::Error::other(format!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
            Ok(())
        };
        let s = |p: &PathBuf| p.to_str().expect("a UTF-8 path").to_owned();
        let (ca, ca_key) = (path("ca.pem"), path("ca.key"));
        let curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let mut args = vec!["req", "-x509"];
        args.extend(curve);
        let (ca_s, ca_key_s) = (s(&ca), s(&ca_key));
        let subject = format!("/CN={name}-ca");
        args.extend(["-keyout", &ca_key_s, "-out", &ca_s, "-days", "2", "-subj", &subject]);
        run(&args)?;
        let sign = |who: &str, subject: &str, ext: &str| -> std::io::Result<(PathBuf, PathBuf)> {
            let (cert, key, csr, extfile) = (
                path(&format!("{who}.pem")),
                path(&format!("{who}.key")),
                path(&format!("{who}.csr")),
                path(&format!("{who}.ext")),
            );
            std::fs::write(&extfile, ext)?;
            let (key_s, csr_s, cert_s, ext_s) = (s(&key), s(&csr), s(&cert), s(&extfile));
            let mut args = vec!["req"];
            args.extend(curve);
            args.extend(["-keyout", &key_s, "-out", &csr_s, "-subj", subject]);
            run(&args)?;
            run(&[
                "x509",
                "-req",
                "-in",
                &csr_s,
                "-CA",
                &ca_s,
                "-CAkey",
                &ca_key_s,
                "-CAcreateserial",
                "-out",
                &cert_s,
                "-days",
                "2",
                "-extfile",
                &ext_s,
            ])?;
            Ok((cert, key))
        };
        // Client use too: etcd's JSON gateway dials etcd's own listener with it.
        let server =
            sign("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")?;
        let client = sign("client", "/CN=root", "extendedKeyUsage=clientAuth\n")?;
        let gateway_client = sign("gateway-client", "/O=tycho-test", "extendedKeyUsage=clientAuth\n")?;
        Ok(TestPki { ca, server, client, gateway_client })
    }
}

/// A running (or deliberately stopped) single-member etcd cluster.
///
/// The process is killed and its data directory removed on drop, including during a panic.
#[derive(Debug)]
pub struct EtcdServer {
    config: EtcdConfig,
    binary: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// The TLS client listener's port, with [`EtcdConfig::tls`].
    tls_port: Option<u16>,
    // Dropped after the child is killed (fields drop in order, and `Drop` kills first).
    dir: TempDir,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd with the default configuration.
    pub fn start_new() -> std::io::Result<EtcdServer> {
        EtcdServer::start_with(EtcdConfig::default())
    }

    /// Starts etcd on two free loopback ports with an empty data directory and waits until it
    /// is healthy. A port taken between choosing it and etcd binding it is retried with new ports.
    pub fn start_with(config: EtcdConfig) -> std::io::Result<EtcdServer> {
        let binary = match &config.binary {
            Some(b) => b.clone(),
            None => find_etcd()?,
        };
        let mut last_error = None;
        for _ in 0..3 {
            let (client_port, peer_port) = free_port_pair()?;
            let tls_port = match &config.tls {
                Some(_) => Some(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port()),
                None => None,
            };
            let dir = TempDir::new("tycho-etcd")?;
            let mut server = EtcdServer {
                config: config.clone(),
                binary: binary.clone(),
                client_port,
                peer_port,
                tls_port,
                dir,
                child: None,
            };
            match server.start() {
                Ok(()) => return Ok(server),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.unwrap_or_else(|| std::io::Error::other("etcd did not start")))
    }

    /// The client URL, `http://127.0.0.1:{port}`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The TLS client URL, `https://127.0.0.1:{port}`, with [`EtcdConfig::tls`].
    pub fn tls_endpoint(&self) -> Option<String> {
        self.tls_port.map(|p| format!("https://127.0.0.1:{p}"))
    }

    /// The client address.
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.client_port))
    }

    /// The member's data directory (kept across [`stop`](Self::stop) and [`start`](Self::start)).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process is running (it may still be electing itself leader).
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Kills the process (SIGKILL, like a crash) and waits for it to exit. Data stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the member again — same ports, same data directory — and waits until healthy.
    /// Does nothing if it is already running.
    pub fn start(&mut self) -> std::io::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        let mut client = self.endpoint();
        let mut tls_args = Vec::new();
        if let (Some(pki), Some(tls)) = (&self.config.tls, self.tls_endpoint()) {
            client = format!("{client},{tls}");
            tls_args = vec![
                format!("--cert-file={}", pki.server.0.display()),
                format!("--key-file={}", pki.server.1.display()),
                format!("--trusted-ca-file={}", pki.ca.display()),
                "--client-cert-auth".to_owned(),
            ];
        }
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path())?;
        let child = Command::new(&self.binary)
            .arg("--name=tycho-test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=tycho-test={peer}"))
            .arg("--initial-cluster-state=new")
            .arg("--initial-cluster-token=tycho-test")
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .args(&tls_args)
            .args(&self.config.extra_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot run {}: {e}", self.binary.display())))?;
        self.child = Some(child);
        let deadline = Instant::now() + self.config.startup_timeout;
        loop {
            if !self.is_running() {
                self.stop();
                return Err(std::io::Error::other(format!("etcd exited during startup; log:\n{}", self.log_tail())));
            }
            if healthy(self.client_addr()) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(std::io::Error::other(format!(
                    "etcd not healthy within {:?}; log:\n{}",
                    self.config.startup_timeout,
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// The last few KiB of etcd's own log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read(self.log_path()).unwrap_or_default();
        let start = text.len().saturating_sub(4096);
        String::from_utf8_lossy(&text[start..]).into_owned()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `$TYCHO_ETCD_BIN`, else `etcd` on `PATH`, else `/usr/bin/etcd`.
fn find_etcd() -> std::io::Result<PathBuf> {
    if let Some(p) = std::env::var_os("TYCHO_ETCD_BIN") {
        return Ok(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join("etcd"))
        .find(|p| is_file(p));
    let fallback = PathBuf::from("/usr/bin/etcd");
    on_path.or_else(|| is_file(&fallback).then_some(fallback)).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no etcd binary: install Debian's etcd-server (scripts/test does) or set TYCHO_ETCD_BIN",
        )
    })
}

fn is_file(p: &Path) -> bool {
    p.metadata().map(|m| m.is_file()).unwrap_or(false)
}

/// Two distinct ports the kernel considers free right now (both held while choosing).
fn free_port_pair() -> std::io::Result<(u16, u16)> {
    let a = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let b = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// `GET /health` answers `{"health":"true"}` once the member has a leader and serves requests.
fn healthy(addr: SocketAddr) -> bool {
    let probe = || -> std::io::Result<bool> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body.contains("\"health\":\"true\""))
    };
    probe().unwrap_or(false)
}
