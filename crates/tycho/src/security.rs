//! The flags by which every role and tool authenticates (`--secret-file`, `--insecure`), and
//! how they become a server's secret or a client's credentials.

use std::sync::Arc;

use clap::Args;
use tycho_proto::auth::Secret;

/// How a process authenticates: the cluster secret, or `--insecure`.
#[derive(Args, Debug, Clone, Default)]
pub struct SecurityArgs {
    /// File holding the cluster secret (mode 0600). Default: `TYCHO_SECRET_FILE`, else
    /// `TYCHO_SECRET`, else (a master) the file it keeps for its port in the runtime directory,
    /// created on first start, or (a node) the file of its master's port there.
    #[arg(long = "secret-file", value_name = "PATH")]
    pub secret_file: Option<std::path::PathBuf>,
    /// Run without authentication or capabilities: anyone who reaches the ports may read,
    /// overwrite and delete everything. For benchmarks and isolated test machines only.
    #[arg(long)]
    pub insecure: bool,
}

impl SecurityArgs {
    /// The secret a server listening on `port` uses, announced on stdout; `None` with
    /// `--insecure`, announced on stderr.
    pub fn server_secret(&self, port: u16) -> Result<Option<Arc<Secret>>, String> {
        use tycho_proto::auth::files::{self, Origin};
        if self.insecure {
            eprintln!(
                "WARNING: --insecure: no authentication and no capabilities; anyone who can reach port {port} or a \
                 node may read, overwrite and delete every object"
            );
            return Ok(None);
        }
        let (secret, origin) = files::server_secret(self.secret_file.as_deref(), &files::port_name(port))
            .map_err(|e| format!("cluster secret: {e}"))?;
        let fp = secret.fingerprint();
        match origin {
            Origin::Given(from) => println!("cluster secret from {from} (fingerprint {fp})"),
            Origin::Reused(p) | Origin::Created(p) => println!(
                "cluster secret in {} (fingerprint {fp}); processes of this user on this host find it; \
                 elsewhere set TYCHO_SECRET_FILE to a copy (docs/security.md)",
                p.display()
            ),
        }
        Ok(Some(Arc::new(secret)))
    }

    /// How a client process (a node) authenticates.
    pub fn client_auth(&self) -> Result<tycho_client::ClientAuth, String> {
        if self.insecure {
            return Ok(tycho_client::ClientAuth::Insecure);
        }
        match &self.secret_file {
            Some(p) => tycho_proto::auth::files::load(p)
                .map(|s| tycho_client::ClientAuth::Secret(Arc::new(s)))
                .map_err(|e| format!("cluster secret: {e}")),
            None => Ok(tycho_client::ClientAuth::Discover),
        }
    }
}
