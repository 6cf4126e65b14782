//! Helpers shared by the real-process test files (each includes this module).

use std::sync::Arc;
use std::time::Duration;

use tycho_client::ClientAuth;
use tycho_proto::auth::Secret;
use tycho_proto::{ClientId, Request, Response};

/// A raw connection to the master at `addr` as a newly registered client of `tenant`: its id
/// and the connection, which greets with the client's identity and credential.
pub fn registered(addr: &str, secret: &Arc<Secret>, tenant: &str) -> (ClientId, tycho_rpc::BlockingClient) {
    let t = Duration::from_secs(10);
    let auth = ClientAuth::Secret(secret.clone());
    let plain =
        tycho_rpc::BlockingClient::new(addr, tycho_rpc::ClientConfig { auth: auth.clone(), ..Default::default() });
    let Response::Registered { client, credential } =
        plain.call::<Request, Response>(&Request::Register { tenant: tenant.into() }, t).unwrap()
    else {
        panic!("no registration")
    };
    let identity =
        tycho_proto::auth::handshake::Identity::Client { client: client.0, tenant: tenant.into(), credential };
    let cfg = tycho_rpc::ClientConfig { auth, identity: Some(identity), ..Default::default() };
    (client, tycho_rpc::BlockingClient::new(addr, cfg))
}
