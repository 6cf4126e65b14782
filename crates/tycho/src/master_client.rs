//! A thin typed caller of a master, for the CLI and the benchmarks.

use std::time::Duration;

use tycho_proto::{ErrorCode, KeyRef, Request, Response};
use tycho_rpc::{ClientConfig, RpcClient};

/// Deadline of one admin or benchmark call.
pub const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// A connection to a master.
#[derive(Clone)]
pub struct MasterClient {
    rpc: RpcClient,
}

impl MasterClient {
    /// Connects to the master at `addr`.
    /// It proves the admin credential when it finds the cluster secret: these are operators'
    /// tools, which act across tenants.
    pub async fn connect(addr: &str) -> Result<MasterClient, ErrorCode> {
        let cfg = ClientConfig::admin(addr).map_err(|e| {
            eprintln!("error: {e}");
            e.code()
        })?;
        let rpc = RpcClient::connect(addr, &cfg).await.map_err(|e| {
            tracing::debug!(error = %e, "connect failed");
            e.code()
        })?;
        Ok(MasterClient { rpc })
    }

    /// One call; a request-level error comes back as `Err`.
    pub async fn call(&self, req: &Request) -> Result<Response, ErrorCode> {
        match self.rpc.call::<Request, Response>(req, CALL_DEADLINE).await {
            Ok(Response::Error(code)) => Err(code),
            Ok(r) => Ok(r),
            Err(e) => Err(e.code()),
        }
    }
}

/// The key reference a client sends for `(tenant, key)` under the initial epoch.
pub fn key_ref(tenant: &str, key: &str) -> KeyRef {
    KeyRef { key: key.to_string(), route: tycho_routing::route_for(tenant, key, tycho_routing::INITIAL_GROUP_EPOCH) }
}
