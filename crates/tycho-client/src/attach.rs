//! Attaching to a `tycho node` on the same host (Mooncake's "dummy client", `setup_dummy`).
//!
//! A node started with `--port P` listens on `client-P.sock` in the user's runtime directory
//! (mode 0700, see `tycho_proto::auth::files`). A process of the same user that connects there
//! (both sides check the other's uid with `SO_PEERCRED`) learns what it needs to become a
//! client of the node's store without being told anything else: the masters' address, the
//! cluster's key (if the cluster authenticates), the node's host identity and its tenant. It
//! then contributes no memory of its own: it writes into and reads from the store's segments,
//! those of the node included, the node's through a mapping of the node's memfd that the node
//! hands over on its transfer socket against a capability, with one copy either way.
//!
//! The key never leaves the host: it goes only to a process of the user the node runs as, who
//! could read it from the node's memory anyway.
//!
//! ```text
//! request:  "TYATTACH" | version u16
//! answer:   "TYATTACH" | version u16 | status i32 (0, or an error code)
//!           | has key u8 | key [32] | master, host id, tenant (each u32 length + UTF-8)
//! ```

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tycho_proto::auth::{files, Secret};
use tycho_proto::ErrorCode;
use tycho_transfer::local::{peer_cred, uid, UnixServer};
use tycho_transfer::TransferError;

use crate::config::ClientAuth;

const MAGIC: &[u8; 8] = b"TYATTACH";
/// Version of the exchange; a peer of another version is refused.
const VERSION: u16 = 1;
/// Longest text field accepted (an address list, a host id, a tenant).
const MAX_FIELD: usize = 64 << 10;
/// How long an attaching process waits for the node's answer.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Mooncake's default port of a real client (`mooncake_client --port`).
pub const DEFAULT_PORT: u16 = 50052;

/// The socket a node listening for attaching processes on `port` binds.
pub fn socket_path(port: u16) -> PathBuf {
    files::runtime_dir().join(format!("client-{port}.sock"))
}

/// What a node tells a process that attaches to it.
#[derive(Clone)]
pub struct AttachInfo {
    /// The masters' address, as the node was given it.
    pub master_addr: String,
    /// The cluster's key; `None` for a cluster without authentication.
    pub secret: Option<Arc<Secret>>,
    /// The node's host identity (same-host transfers need the same one).
    pub host_id: String,
    /// The node's tenant.
    pub tenant: String,
}

impl AttachInfo {
    /// How a client built from this proves itself.
    pub fn auth(&self) -> ClientAuth {
        match &self.secret {
            Some(s) => ClientAuth::Secret(s.clone()),
            None => ClientAuth::Insecure,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = head();
        out.extend_from_slice(&0i32.to_le_bytes());
        out.push(self.secret.is_some() as u8);
        out.extend_from_slice(&self.secret.as_ref().map_or([0; 32], |s| s.key()));
        for field in [&self.master_addr, &self.host_id, &self.tenant] {
            out.extend_from_slice(&(field.len() as u32).to_le_bytes());
            out.extend_from_slice(field.as_bytes());
        }
        out
    }
}

fn head() -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&VERSION.to_le_bytes());
    out
}

fn refusal(code: ErrorCode) -> Vec<u8> {
    let mut out = head();
    out.extend_from_slice(&(code as i32).to_le_bytes());
    out
}

/// Reads a magic and version, refusing anything else.
fn read_head(s: &mut impl Read) -> Result<(), ErrorCode> {
    let mut h = [0u8; 10];
    s.read_exact(&mut h).map_err(|_| ErrorCode::RPC_FAIL)?;
    if &h[..8] != MAGIC || u16::from_le_bytes([h[8], h[9]]) != VERSION {
        return Err(ErrorCode::INVALID_VERSION);
    }
    Ok(())
}

fn read_field(s: &mut impl Read) -> Result<String, ErrorCode> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n).map_err(|_| ErrorCode::RPC_FAIL)?;
    let n = u32::from_le_bytes(n) as usize;
    if n > MAX_FIELD {
        return Err(ErrorCode::INVALID_PARAMS);
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).map_err(|_| ErrorCode::RPC_FAIL)?;
    String::from_utf8(b).map_err(|_| ErrorCode::INVALID_PARAMS)
}

fn decode(s: &mut impl Read) -> Result<AttachInfo, ErrorCode> {
    read_head(s)?;
    let mut status = [0u8; 4];
    s.read_exact(&mut status).map_err(|_| ErrorCode::RPC_FAIL)?;
    let status = i32::from_le_bytes(status);
    if status != 0 {
        return Err(ErrorCode::from_i32(status).unwrap_or(ErrorCode::INTERNAL_ERROR));
    }
    let mut key = [0u8; 33];
    s.read_exact(&mut key).map_err(|_| ErrorCode::RPC_FAIL)?;
    let secret = match key[0] {
        0 => None,
        1 => Some(Arc::new(Secret::from_key(key[1..].try_into().expect("32 bytes")))),
        _ => return Err(ErrorCode::INVALID_PARAMS),
    };
    let master_addr = read_field(s)?;
    let host_id = read_field(s)?;
    let tenant = read_field(s)?;
    Ok(AttachInfo { master_addr, secret, host_id, tenant })
}

/// A node's listener for attaching processes; stops (and removes its socket) when dropped.
pub struct AttachServer {
    _server: UnixServer,
}

impl AttachServer {
    /// Listens on [`socket_path`]`(port)` and answers processes of this user with `info`.
    pub fn serve(port: u16, info: AttachInfo) -> Result<AttachServer, TransferError> {
        Self::serve_at(socket_path(port), info)
    }

    fn serve_at(path: PathBuf, info: AttachInfo) -> Result<AttachServer, TransferError> {
        let answer = info.encode();
        let server = UnixServer::bind(path, "tycho-attach", move |s| {
            let (peer_uid, peer_pid) = peer_cred(s)?;
            let mut s = s;
            if peer_uid != uid() {
                s.write_all(&refusal(ErrorCode::PERMISSION_DENIED))?;
                return Ok(());
            }
            if read_head(&mut s).is_err() {
                s.write_all(&refusal(ErrorCode::INVALID_VERSION))?;
                return Ok(());
            }
            s.write_all(&answer)?;
            tracing::info!(pid = peer_pid, "a process attached");
            Ok(())
        })?;
        Ok(AttachServer { _server: server })
    }
}

/// Whether a node of this user listens for attaching processes on `port` (a silent check).
pub fn listening(port: u16) -> bool {
    UnixStream::connect(socket_path(port))
        .ok()
        .and_then(|s| peer_cred(&s).ok())
        .is_some_and(|(node_uid, _)| node_uid == uid())
}

/// Asks the node listening on `port` of this host for what a client of its store needs.
/// RPC_FAIL when no node of this user listens there; PERMISSION_DENIED from a node of another
/// user; INVALID_VERSION from a node of another build.
pub fn attach(port: u16) -> Result<AttachInfo, ErrorCode> {
    attach_at(&socket_path(port))
}

fn attach_at(path: &std::path::Path) -> Result<AttachInfo, ErrorCode> {
    let mut s = UnixStream::connect(path).map_err(|e| {
        tracing::error!(socket = %path.display(), error = %e, "no tycho node of this user listens for attaching processes there");
        ErrorCode::RPC_FAIL
    })?;
    let (node_uid, _) = peer_cred(&s).map_err(|_| ErrorCode::RPC_FAIL)?;
    if node_uid != uid() {
        return Err(ErrorCode::PERMISSION_DENIED);
    }
    s.set_read_timeout(Some(TIMEOUT)).map_err(|_| ErrorCode::RPC_FAIL)?;
    s.set_write_timeout(Some(TIMEOUT)).map_err(|_| ErrorCode::RPC_FAIL)?;
    s.write_all(&head()).map_err(|_| ErrorCode::RPC_FAIL)?;
    decode(&mut s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip_and_bad_ones_are_refused() {
        let info = AttachInfo {
            master_addr: "127.0.0.1:50051,127.0.0.1:50061".into(),
            secret: Some(Arc::new(Secret::from_key([7; 32]))),
            host_id: "h".into(),
            tenant: "t".into(),
        };
        let got = decode(&mut &info.encode()[..]).unwrap();
        assert_eq!(got.master_addr, info.master_addr);
        assert_eq!(got.secret.unwrap().key(), [7; 32]);
        assert_eq!((got.host_id.as_str(), got.tenant.as_str()), ("h", "t"));
        let open = AttachInfo { secret: None, ..info.clone() };
        assert!(decode(&mut &open.encode()[..]).unwrap().secret.is_none());
        assert_eq!(decode(&mut &refusal(ErrorCode::PERMISSION_DENIED)[..]).err(), Some(ErrorCode::PERMISSION_DENIED));
        // Every truncation fails cleanly; so does another version, or an oversized field.
        let full = info.encode();
        for cut in 0..full.len() {
            assert!(decode(&mut &full[..cut]).is_err(), "cut at {cut}");
        }
        let mut other = full.clone();
        other[8] = 9;
        assert_eq!(decode(&mut &other[..]).err(), Some(ErrorCode::INVALID_VERSION));
        let mut huge = head();
        huge.extend_from_slice(&0i32.to_le_bytes());
        huge.extend_from_slice(&[0; 33]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&mut &huge[..]).err(), Some(ErrorCode::INVALID_PARAMS));
    }

    #[test]
    fn a_process_of_this_user_attaches_over_the_socket() {
        let dir = std::env::temp_dir().join(format!("tycho-attach-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("client-1.sock");
        let info = AttachInfo { master_addr: "m:1".into(), secret: None, host_id: "h".into(), tenant: String::new() };
        let server = AttachServer::serve_at(path.clone(), info).unwrap();
        let got = attach_at(&path).unwrap();
        assert_eq!(got.master_addr, "m:1");
        assert!(matches!(got.auth(), ClientAuth::Insecure));
        drop(server);
        assert!(!path.exists(), "the socket goes with the server");
        assert_eq!(attach_at(&path).err(), Some(ErrorCode::RPC_FAIL));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
