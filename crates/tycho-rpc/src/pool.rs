//! Reuse of connections by address.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::{ClientConfig, RpcClient, RpcError};

/// Keeps one live connection per server address and replaces it when it fails.
#[derive(Default)]
pub struct RpcPool {
    config: ClientConfig,
    conns: Mutex<HashMap<String, RpcClient>>,
}

impl RpcPool {
    /// A pool whose connections use `config`.
    pub fn new(config: ClientConfig) -> RpcPool {
        RpcPool { config, conns: Mutex::new(HashMap::new()) }
    }

    /// A live connection to `addr`, opening one if needed.
    pub async fn get(&self, addr: &str) -> Result<RpcClient, RpcError> {
        if let Some(c) = self.conns.lock().get(addr) {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let fresh = RpcClient::connect(addr, &self.config).await?;
        let mut conns = self.conns.lock();
        // Another caller may have connected meanwhile; keep the live one.
        match conns.get(addr) {
            Some(c) if !c.is_closed() => Ok(c.clone()),
            _ => {
                conns.insert(addr.to_string(), fresh.clone());
                Ok(fresh)
            }
        }
    }

    /// Drops the pooled connection to `addr`, if any.
    pub fn evict(&self, addr: &str) {
        self.conns.lock().remove(addr);
    }
}
