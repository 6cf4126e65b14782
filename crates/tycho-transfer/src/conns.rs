//! The transfer server's table of authenticated connections: how many a node serves, how many
//! one client may hold, and which idle one gives way when a new one needs its place.
//!
//! Clients keep idle connections in a pool to save a greeting per request, so a node full of
//! connections is mostly a node full of idle ones. Rather than turn a new peer away while
//! others sleep, the node closes the connection idle the longest (idle for at least
//! [`ServerLimits::evict_after`](crate::server::ServerLimits::evict_after)) to make room: its
//! client notices on its next request and reconnects without its caller seeing anything
//! (`engine.rs` retries a request a pooled connection could not deliver). A few hundred idle
//! sockets therefore never lock a reader out; only connections all busy at once fill the node.

use std::collections::HashMap;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The node serves as many connections as it may, none of them idle long enough to close.
    Full,
    /// This client holds as many connections as one client may.
    ClientFull,
}

struct Entry {
    /// A handle to the socket, to close it when it gives way.
    stream: TcpStream,
    client: Option<u128>,
    /// Since when it waits for a request (`None`: serving one).
    idle_since: Option<Instant>,
}

/// The authenticated connections of one server.
pub(crate) struct Conns {
    max: usize,
    per_client: usize,
    evict_after: Duration,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    live: HashMap<u64, Entry>,
    per_client: HashMap<u128, usize>,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.live.remove(&id)?;
        if let Some(c) = e.client {
            if let Some(n) = self.per_client.get_mut(&c) {
                *n -= 1;
                if *n == 0 {
                    self.per_client.remove(&c);
                }
            }
        }
        Some(e)
    }
}

impl Conns {
    pub(crate) fn new(max: usize, per_client: usize, evict_after: Duration) -> Conns {
        Conns { max, per_client, evict_after, inner: Mutex::new(Inner::default()) }
    }

    /// Admits a connection whose greeting proved `client` (or only the secret): its id, or why
    /// not. At the limit, the connection idle the longest gives way if it has been idle for
    /// `evict_after`.
    pub(crate) fn admit(&self, stream: &TcpStream, client: Option<u128>) -> Result<u64, Refusal> {
        let handle = stream.try_clone().map_err(|_| Refusal::Full)?;
        let mut inner = self.inner.lock();
        if let Some(c) = client {
            if inner.per_client.get(&c).copied().unwrap_or(0) >= self.per_client {
                return Err(Refusal::ClientFull);
            }
        }
        if inner.live.len() >= self.max {
            let now = Instant::now();
            let oldest = inner
                .live
                .iter()
                .filter_map(|(id, e)| e.idle_since.map(|t| (t, *id)))
                .filter(|(t, _)| now.duration_since(*t) >= self.evict_after)
                .min();
            let Some((_, id)) = oldest else { return Err(Refusal::Full) };
            if let Some(e) = inner.remove(id) {
                // Its thread sees the socket closed and ends; its client reconnects.
                let _ = e.stream.shutdown(std::net::Shutdown::Both);
            }
        }
        inner.next += 1;
        let id = inner.next;
        inner.live.insert(id, Entry { stream: handle, client, idle_since: Some(Instant::now()) });
        if let Some(c) = client {
            *inner.per_client.entry(c).or_default() += 1;
        }
        Ok(id)
    }

    /// Marks the connection idle (waiting for a request) or busy; false if it was closed to
    /// make room, and must end.
    pub(crate) fn set_idle(&self, id: u64, idle: bool) -> bool {
        let mut inner = self.inner.lock();
        match inner.live.get_mut(&id) {
            Some(e) => {
                e.idle_since = idle.then(Instant::now);
                true
            }
            None => false,
        }
    }

    /// Forgets a connection that ended.
    pub(crate) fn leave(&self, id: u64) {
        self.inner.lock().remove(id);
    }

    /// Connections admitted and not ended.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket() -> (TcpStream, TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    #[test]
    fn the_longest_idle_connection_gives_way_and_busy_ones_never_do() {
        let conns = Conns::new(2, 8, Duration::ZERO);
        let (a_peer, a) = socket();
        let (_b_peer, b) = socket();
        let (_c_peer, c) = socket();
        let ida = conns.admit(&a, None).unwrap();
        let idb = conns.admit(&b, None).unwrap();
        assert!(conns.set_idle(idb, false), "b serves a request");
        // Full: a (idle the longest, and only a) gives way to c.
        let idc = conns.admit(&c, None).unwrap();
        assert_eq!(conns.len(), 2);
        assert!(!conns.set_idle(ida, false), "a was closed");
        let mut buf = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut &a_peer, &mut buf).unwrap(), 0, "a's peer sees it closed");
        // Both busy now: nothing gives way.
        assert!(conns.set_idle(idc, false));
        let (_d_peer, d) = socket();
        assert_eq!(conns.admit(&d, None), Err(Refusal::Full));
        conns.leave(idb);
        assert!(conns.admit(&d, None).is_ok());
    }

    #[test]
    fn a_client_holds_at_most_its_share_and_idle_ones_give_way_only_when_idle_long_enough() {
        let conns = Conns::new(3, 2, Duration::from_secs(3600));
        let s: Vec<_> = (0..4).map(|_| socket()).collect();
        let one = conns.admit(&s[0].1, Some(7)).unwrap();
        conns.admit(&s[1].1, Some(7)).unwrap();
        assert_eq!(conns.admit(&s[2].1, Some(7)), Err(Refusal::ClientFull));
        conns.admit(&s[2].1, Some(8)).unwrap();
        // Full, and nobody has been idle for an hour.
        assert_eq!(conns.admit(&s[3].1, Some(9)), Err(Refusal::Full));
        conns.leave(one);
        assert!(conns.admit(&s[3].1, Some(7)).is_ok(), "client 7 has room again");
    }
}
