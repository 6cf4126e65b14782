//! Test harness: real external services for Tycho's integration tests, and Tycho's own
//! processes ([`MasterProc`], [`NodeProc`]) on kernel-chosen loopback ports.
//!
//! [`EtcdServer`] starts the system's `etcd` binary (Debian's `etcd-server` package puts it at
//! `/usr/bin/etcd`; `scripts/test` installs it) on free loopback ports with a private data
//! directory, waits until it reports healthy, and kills it when dropped — also when the test
//! panics, because the drop runs while the panic unwinds. A test can [`stop`](EtcdServer::stop)
//! and [`start`](EtcdServer::start) the same member again (same ports, same data) to inject a
//! coordinator outage.
//!
//! ```no_run
//! let etcd = tycho_testkit::EtcdServer::start_new().expect("etcd starts");
//! println!("client endpoint: {}", etcd.endpoint());
//! ```

mod etcd;
mod process;
mod temp_dir;

pub use etcd::{EtcdConfig, EtcdServer, TestPki};
pub use process::{run_cli, text, MasterProc, NodeProc, Proc};
pub use temp_dir::TempDir;
