//! A thin typed caller of a master, for the CLI and the benchmarks.

use std::time::Duration;

use tycho_proto::auth::handshake::Identity;
use tycho_proto::{ErrorCode, KeyRef, Request, Response};
use tycho_rpc::{ClientConfig, RpcClient};

/// Deadline of one admin or benchmark call.
pub const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// A connection to a master.
#[derive(Clone)]
pub struct MasterClient {
    rpc: RpcClient,
}

/// Client identities later connections to a master prove instead of the admin credential
/// (see [`act_as`]).
static ACTING_AS: std::sync::Mutex<Vec<(String, Identity)>> = std::sync::Mutex::new(Vec::new());

/// Makes every later [`MasterClient::connect`] to `addr` prove `identity` (a registered
/// client's) instead of the admin credential: a benchmark then measures the path ordinary
/// clients take, authorization included.
pub fn act_as(addr: &str, identity: Identity) {
    let mut list = ACTING_AS.lock().unwrap_or_else(|e| e.into_inner());
    list.retain(|(a, _)| a != addr);
    list.push((addr.to_string(), identity));
}

impl MasterClient {
    /// Connects to the master at `addr`.
    /// It proves the admin credential when it finds the cluster secret: these are operators'
    /// tools, which act across tenants (unless [`act_as`] said otherwise for `addr`).
    pub async fn connect(addr: &str) -> Result<MasterClient, ErrorCode> {
        let mut cfg = ClientConfig::admin(addr).map_err(|e| {
            eprintln!("error: {e}");
            e.code()
        })?;
        let acting = ACTING_AS.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(a, _)| a == addr).cloned();
        if let (Some((_, identity)), Some(_)) = (acting, &cfg.identity) {
            cfg.identity = Some(identity);
        }
        let rpc = RpcClient::connect(addr, &cfg).await.map_err(|e| {
            tracing::debug!(error = %e, "connect failed");
            e.code()
        })?;
        Ok(MasterClient { rpc })
    }

    /// One call; a request-level error comes back as `Err`.
    pub async fn call(&self, req: &Request) -> Result<Response, ErrorCode> {
        match self.rpc.call::<Request, Response>(req, CALL_DEADLINE).await {
            Ok(r) => match r.error_code() {
                Some(code) => Err(code),
                None => Ok(r),
            },
            Err(e) => Err(e.code()),
        }
    }
}

/// The key reference a client sends for `(tenant, key)` under the initial epoch.
pub fn key_ref(tenant: &str, key: &str) -> KeyRef {
    KeyRef { key: key.to_string(), route: tycho_routing::route_for(tenant, key, tycho_routing::INITIAL_GROUP_EPOCH) }
}
