//! What every benchmark driver needs around the thing it measures: free loopback ports,
//! child processes that die with the driver, a master started on a free port, and CPU and
//! context-switch figures from `/proc`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// CPU seconds this process has used, user and system.
pub(crate) fn cpu_self() -> f64 {
    // SAFETY: getrusage writes into the struct we pass and reads nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds the whole machine has spent busy and idle since boot, from `/proc/stat`
/// (zeros where it cannot be read).
pub(crate) fn machine_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = stat.lines().next().unwrap_or("");
    let f: Vec<f64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let hz = clock_ticks_per_sec();
    let at = |i: usize| f.get(i).copied().unwrap_or(0.0) / hz;
    // Fields: user nice system idle iowait irq softirq steal (guest time is inside user).
    (at(0) + at(1) + at(2) + at(5) + at(6) + at(7), at(3) + at(4))
}

/// CPU seconds process `pid` has used, user and system (`None` where it cannot be read).
pub(crate) fn cpu_of(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / clock_ticks_per_sec())
}

/// Context switches of every thread of process `pid` so far, voluntary and not, from
/// `/proc/{pid}/task/*/status` (threads that ended are not counted).
pub(crate) fn switches_of(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    let mut n = 0;
    for t in tasks.flatten() {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        for line in status.lines() {
            if let Some(v) =
                line.strip_prefix("voluntary_ctxt_switches:").or(line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                n += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    n
}

/// The unit of CPU times in `/proc`.
fn clock_ticks_per_sec() -> f64 {
    // SAFETY: sysconf has no memory effects.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// A child process killed when dropped.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until something listens on `port`.
pub fn wait_for_port(port: u16, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("{what} did not start listening on port {port}"))
}

/// Starts `tycho master` (this executable) with `extra` arguments on a free loopback port.
pub(crate) fn start_master(client_ttl_s: u64, extra: &[&str]) -> Result<(ChildGuard, String), String> {
    let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
    cmd.args(["master", "--metrics-port", "0"]).args(extra);
    start_master_with(client_ttl_s, cmd)
}

/// Starts `tycho master` from `cmd` (the executable and the caller's arguments) on a free
/// loopback RPC port and waits until it listens.
pub(crate) fn start_master_with(client_ttl_s: u64, mut cmd: Command) -> Result<(ChildGuard, String), String> {
    let port = free_port();
    let child = cmd
        .args(["--rpc-address", "127.0.0.1", "--rpc-port", &port.to_string()])
        .args(["--client-ttl", &client_ttl_s.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start master: {e}"))?;
    let guard = ChildGuard(child);
    wait_for_port(port, "master")?;
    Ok((guard, format!("127.0.0.1:{port}")))
}
