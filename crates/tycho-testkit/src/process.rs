//! Tycho's own processes (`tycho master`, `tycho node`) started by integration tests.
//!
//! Every listener is bound to port 0 and the test learns the real address from the line the
//! process prints once it is listening. Choosing a "free" port first and passing it on races
//! with everything else that binds or connects on the machine while tests run in parallel; a
//! lost race used to make a test talk to some other test's server.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// How long a process may take to print the line that says it is listening.
const STARTUP: Duration = Duration::from_secs(30);

/// A child process that is killed and reaped when dropped, also while a test panics.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    lines: Receiver<String>,
}

impl Proc {
    /// Spawns `cmd` with its stdout captured line by line (stderr stays the test's).
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Proc> {
        let mut child = cmd.stdout(Stdio::piped()).spawn()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The receiver may be gone; keep draining so the child never blocks on a full pipe.
                let _ = tx.send(line);
            }
        });
        Ok(Proc { child, lines })
    }

    /// Waits for a stdout line starting with `prefix` and returns the rest of it. Fails if the
    /// process exits first or nothing matches within `limit`.
    pub fn wait_line(&mut self, prefix: &str, limit: Duration) -> std::io::Result<String> {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return Ok(rest.to_string());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no line starting with {prefix:?} within {limit:?}"),
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait()?;
                    return Err(std::io::Error::other(format!(
                        "exited ({status}) before printing a line starting with {prefix:?}"
                    )));
                }
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (for example 15 for SIGTERM, 9 for SIGKILL) unless the process has
    /// already exited and been reaped.
    pub fn signal(&mut self, signal: i32) {
        extern "C" {
            fn kill(pid: i32, sig: i32) -> i32;
        }
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        // SAFETY: `kill` takes plain integers; the pid is our own child, still running or a
        // zombie we have not reaped, so it cannot name a recycled process.
        unsafe { kill(self.child.id() as i32, signal) };
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `tycho master` with its RPC and admin HTTP addresses.
#[derive(Debug)]
pub struct MasterProc {
    /// The process; dropping it kills the master.
    pub proc: Proc,
    /// `host:port` of the RPC listener.
    pub rpc: String,
    /// `host:port` of the admin HTTP server.
    pub http: String,
}

/// The state directory of the masters this test process starts (one per process, under the
/// temporary directory; each master keeps its own subdirectory by its id).
fn test_state_home() -> &'static std::path::Path {
    static HOME: std::sync::OnceLock<crate::TempDir> = std::sync::OnceLock::new();
    HOME.get_or_init(|| crate::TempDir::new("tycho-test-state").expect("a temporary directory")).path()
}

impl MasterProc {
    /// Starts `<bin> master` on loopback with both listeners on kernel-chosen ports and `extra`
    /// flags after them.
    pub fn start(bin: &str, extra: &[&str]) -> MasterProc {
        MasterProc::start_on(bin, 0, extra)
    }

    /// Starts a master whose RPC listener is on `port` of 127.0.0.1 (0: any free port), as a
    /// restart test does to bring a master back where its clients look for it.
    pub fn start_on(bin: &str, port: u16, extra: &[&str]) -> MasterProc {
        MasterProc::start_env(bin, port, extra, &[])
    }

    /// [`start_on`](Self::start_on) with extra environment variables.
    pub fn start_env(bin: &str, port: u16, extra: &[&str], env: &[(&str, &str)]) -> MasterProc {
        let mut cmd = Command::new(bin);
        cmd.args(["master", "--rpc-address", "127.0.0.1", "--rpc-port", &port.to_string()])
            .args(["--metrics-address", "127.0.0.1", "--metrics-port", "0"])
            .args(extra)
            // The masters' data directories (snapshots), out of the user's home.
            .env("XDG_STATE_HOME", test_state_home())
            .envs(env.iter().copied());
        let mut proc = Proc::spawn(&mut cmd).expect("spawn tycho master");
        let rpc = proc.wait_line("tycho master listening on ", STARTUP).expect("tycho master starts");
        let http = proc.wait_line("tycho master admin HTTP on http://", STARTUP).expect("tycho master admin HTTP");
        MasterProc { proc, rpc, http }
    }

    /// The RPC port.
    pub fn port(&self) -> u16 {
        self.rpc.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("host:port")
    }
}

/// A running `tycho node` serving one segment.
#[derive(Debug)]
pub struct NodeProc {
    /// The process; dropping it kills the node.
    pub proc: Proc,
    /// `host:port` of its transfer server, which is also its segment's name.
    pub hostname: String,
}

impl NodeProc {
    /// Starts `<bin> node` against `master` with a segment of `size` (for example `"64MB"`),
    /// its transfer server on a kernel-chosen loopback port.
    pub fn start(bin: &str, master: &str, size: &str) -> NodeProc {
        NodeProc::start_env(bin, master, size, &[], &[])
    }

    /// [`start`](Self::start) with extra flags and environment variables.
    pub fn start_env(bin: &str, master: &str, size: &str, extra: &[&str], env: &[(&str, &str)]) -> NodeProc {
        let mut cmd = Command::new(bin);
        cmd.args(["node", "--master", master, "--segment-size", size, "--local-hostname", "127.0.0.1:0"])
            .args(extra)
            .envs(env.iter().copied());
        // No socket for attaching processes unless the test asks for one: test nodes run side
        // by side and must not take the default port from each other (or from the user's node).
        if !extra.contains(&"--port") {
            cmd.args(["--port", "0"]);
        }
        let mut proc = Proc::spawn(&mut cmd).expect("spawn tycho node");
        let line = proc.wait_line("tycho node serving ", STARTUP).expect("tycho node starts");
        // "<bytes> bytes at <host:port> (master <addr>)"
        let hostname = line
            .split_once(" at ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .expect("the node prints its transfer address")
            .to_string();
        NodeProc { proc, hostname }
    }
}

/// Runs the command-line tool `bin` once: `bin <args> --master <master>`, with `env` added to
/// its environment (the cluster secret variables removed first, so that a test names its
/// credentials explicitly) and `input` on standard input; waits for it and returns its output.
pub fn run_cli(bin: &str, master: &str, args: &[&str], env: &[(&str, &str)], input: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(bin)
        .args(args)
        .args(["--master", master])
        .env_remove("TYCHO_SECRET_FILE")
        .env_remove("TYCHO_SECRET")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
    child.stdin.take().expect("piped").write_all(input).expect("write stdin");
    child.wait_with_output().expect("the command runs")
}

/// Output bytes as text, for assertions and messages.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
