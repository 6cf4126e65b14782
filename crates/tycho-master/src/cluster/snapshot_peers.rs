//! Snapshots without a shared filesystem. Each master keeps the snapshots it writes, and those
//! it fetched, in its own data directory; a file it lacks (a standby starting, a reshard target,
//! a caretaker restoring a group) it fetches from the other masters of its cluster, over their
//! authenticated RPC (`SnapshotFile`, the cluster's admin only), one file per call: the
//! manifest or one chunk, each sealed with its kind, version and checksum. A file is checked
//! before it is kept, and a fetched manifest is kept last, once every chunk it lists is here
//! (as the writer writes it): a snapshot whose manifest a master holds is whole there. A fetch
//! cut short resumes where it stopped: the chunks on disk already are not fetched again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tycho_proto::{Request, Response, SnapshotFileQuery};
use tycho_rpc::BlockingClient;

use crate::log::snapshot::{self, DirSnapshotStore, SnapshotId, SnapshotStore};

/// How long one file's fetch may take (a chunk is about 4 MiB).
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a peer may take to start answering (a stopped one is passed over after this).
const FIRST_BYTE: Duration = Duration::from_secs(3);

/// The RPC addresses of the cluster's other masters, as the role loop last read them.
#[derive(Debug, Clone, Default)]
pub struct Peers(Arc<RwLock<Vec<String>>>);

impl Peers {
    /// Replaces the list.
    pub fn set(&self, addresses: Vec<String>) {
        *self.0.write() = addresses;
    }

    /// The list as it stands.
    pub fn list(&self) -> Vec<String> {
        self.0.read().clone()
    }
}

/// A [`SnapshotStore`] in a master's own directory that fetches what it lacks from its peers.
pub struct PeerSnapshotStore {
    local: Arc<DirSnapshotStore>,
    peers: Peers,
    rpc: tycho_rpc::ClientConfig,
    conns: Mutex<HashMap<String, Arc<BlockingClient>>>,
}

impl PeerSnapshotStore {
    /// Snapshots kept in `local`, fetched from `peers` over connections set up as `rpc` says
    /// (the cluster secret and the admin identity derived from it).
    pub fn new(local: Arc<DirSnapshotStore>, peers: Peers, rpc: tycho_rpc::ClientConfig) -> PeerSnapshotStore {
        PeerSnapshotStore { local, peers, rpc, conns: Mutex::new(HashMap::new()) }
    }

    /// The master's own directory (what it serves to its peers).
    pub fn local(&self) -> &Arc<DirSnapshotStore> {
        &self.local
    }

    fn conn(&self, addr: &str) -> Arc<BlockingClient> {
        self.conns
            .lock()
            .entry(addr.to_string())
            .or_insert_with(|| Arc::new(BlockingClient::new(addr, self.rpc.clone())))
            .clone()
    }

    /// `file` of snapshot `id` from the first peer that holds a sound copy.
    fn fetch(&self, id: &SnapshotId, file: &str) -> Option<Vec<u8>> {
        let query = query(id, file);
        for addr in self.peers.list() {
            match self.conn(&addr).call_within::<Request, Response>(
                &Request::SnapshotFile(query.clone()),
                FIRST_BYTE,
                FETCH_TIMEOUT,
            ) {
                Ok(Response::SnapshotFile(Some(bytes))) => match snapshot::check_file(id, &bytes) {
                    Ok(()) => {
                        tracing::debug!(peer = %addr, snapshot = ?id, file, bytes = bytes.len(), "snapshot file fetched");
                        return Some(bytes);
                    }
                    Err(e) => tracing::warn!(peer = %addr, error = %e, "a peer sent a damaged snapshot file"),
                },
                Ok(Response::SnapshotFile(None)) => {}
                Ok(other) => tracing::debug!(peer = %addr, answer = ?other, "a peer did not send a snapshot file"),
                Err(e) => {
                    tracing::debug!(peer = %addr, error = %e, "could not ask a peer for a snapshot file");
                    self.conns.lock().remove(&addr);
                }
            }
        }
        None
    }

    /// How many of the peers hold snapshot `id` whole (its manifest; a manifest is written
    /// last, once every chunk is).
    pub fn peers_holding(&self, id: &SnapshotId) -> usize {
        let query = query(id, snapshot::MANIFEST);
        self.peers
            .list()
            .iter()
            .filter(|addr| {
                matches!(
                    self.conn(addr).call_within::<Request, Response>(&Request::SnapshotFile(query.clone()), FIRST_BYTE, FETCH_TIMEOUT),
                    Ok(Response::SnapshotFile(Some(ref b))) if snapshot::check_file(id, b).is_ok()
                )
            })
            .count()
    }
}

fn query(id: &SnapshotId, file: &str) -> SnapshotFileQuery {
    SnapshotFileQuery {
        group: id.group,
        applied: id.applied,
        epoch: id.epoch,
        writer: id.writer,
        file: file.to_string(),
    }
}

impl SnapshotStore for PeerSnapshotStore {
    fn put(&self, id: &SnapshotId, file: &str, bytes: &[u8]) -> std::io::Result<()> {
        self.local.put(id, file, bytes)
    }

    fn get(&self, id: &SnapshotId, file: &str) -> std::io::Result<Option<Vec<u8>>> {
        if let Some(bytes) = self.local.get(id, file)? {
            return Ok(Some(bytes));
        }
        let Some(bytes) = self.fetch(id, file) else { return Ok(None) };
        if file == snapshot::MANIFEST {
            // The whole snapshot, then its manifest.
            let chunks = snapshot::manifest_chunks(id, &bytes).map_err(std::io::Error::other)?;
            for index in 0..chunks {
                let name = snapshot::chunk_file(index);
                if self.local.has(id, &name) {
                    continue;
                }
                match self.fetch(id, &name) {
                    Some(chunk) => self.local.put(id, &name, &chunk)?,
                    // No peer has it whole any more: the reader finds it incomplete.
                    None => return Ok(None),
                }
            }
        }
        self.local.put(id, file, &bytes)?;
        Ok(Some(bytes))
    }

    fn list(&self, group: u32) -> std::io::Result<Vec<SnapshotId>> {
        self.local.list(group)
    }

    fn delete(&self, id: &SnapshotId) -> std::io::Result<()> {
        self.local.delete(id)
    }

    fn holders(&self, id: &SnapshotId) -> Option<usize> {
        Some(usize::from(self.local.has(id, snapshot::MANIFEST)) + self.peers_holding(id))
    }

    fn holds(&self, id: &SnapshotId) -> bool {
        self.local.has(id, snapshot::MANIFEST)
    }
}

/// Whether `file` names a file of a snapshot (`manifest`, `chunk-NNNNNN`): nothing else is
/// served, so no request reaches outside a snapshot's directory.
pub fn is_snapshot_file(file: &str) -> bool {
    file == snapshot::MANIFEST
        || file.strip_prefix("chunk-").is_some_and(|n| n.len() == 6 && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_snapshot_file_names_are_served() {
        assert!(is_snapshot_file("manifest"));
        assert!(is_snapshot_file("chunk-000012"));
        for bad in [
            "",
            "../manifest",
            "chunk-12",
            "chunk-0000001",
            "chunk-00001a",
            "/etc/passwd",
            "manifest/..",
            ".manifest.tmp",
        ] {
            assert!(!is_snapshot_file(bad), "{bad:?}");
        }
    }
}
