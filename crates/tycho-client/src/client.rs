//! The store client.

use std::collections::{BTreeMap, HashMap};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tycho_proto::auth::handshake::Identity;
use tycho_proto::quota::{check_stable_name, stable_segment_id, Medium};
use tycho_proto::*;
use tycho_routing::RouteCache;
use tycho_rpc::{BlockingClient, ClientConfig as RpcConfig};
use tycho_transfer::{Mapping, Part, SegmentRegistry, ServerLimits, TransferEngine, TransferServer, Transport};

use crate::aggregate::PartialRemoval;
use crate::config::{ClientAuth, ClientConfig, Protocol};
use crate::retry::{call_noting, call_patiently, call_with_retry, Patience};

mod sessions;
mod tasks;

/// Put (put-if-absent) or upsert (replace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Keep an existing value; report success.
    Put,
    /// Replace an existing value.
    Upsert,
}

/// Where an object lives, with the read lease taken when it was looked up.
#[derive(Debug, Clone)]
pub struct Lookup {
    key: String,
    list: ReplicaList,
    asked: Instant,
}

impl Lookup {
    /// Object size in bytes.
    pub fn size(&self) -> u64 {
        self.list.size
    }

    /// Replica descriptors.
    pub fn replicas(&self) -> &[ReplicaDesc] {
        &self.list.replicas
    }
}

/// Most replica lists kept for reuse; the cache is emptied when it is full.
const LEASE_CACHE_ENTRIES: usize = 16 * 1024;

/// A replica list is reused only during this first part of its lease. Its ranges may have been
/// freed and reused since (removal, upsert and eviction free at once); a read through it then
/// fails its generation check (RANGE_REUSED) and the client asks the master again, so a reused
/// list never yields foreign bytes. Reads that would finish after the lease fail with
/// LEASE_EXPIRED.
const LEASE_REUSE_FRACTION: u32 = 2;
/// And for at most this long, which bounds how late a reader sees that an object is gone
/// (its holder died, another client replaced it) while still sparing a hot object all but one
/// master call per second.
const MAX_LEASE_REUSE: Duration = Duration::from_secs(1);

/// Attempts of one read, each with fresh metadata after the first: a key rewritten faster than
/// it can be copied fails with RANGE_REUSED after these rather than spin.
const READ_ATTEMPTS: u32 = 3;

/// Port range a transfer server picks from when the hostname names no port (Mooncake's).
const AUTO_PORT_RANGE: std::ops::Range<u16> = 12300..14300;

struct Segment {
    desc: SegmentDesc,
    memory: Arc<Mapping>,
    /// In a cluster of several groups: which slices were offered to a master under their
    /// current incarnations (see [`Inner::mount_slices_at`]).
    book: SliceBook,
    /// Its stable name and medium, for a stable segment.
    stable: Option<(String, Medium)>,
}

impl Segment {
    /// A segment not mounted anywhere yet.
    fn new(desc: SegmentDesc, memory: Arc<Mapping>) -> Segment {
        Segment { desc, memory, book: SliceBook::default(), stable: None }
    }

    /// Gives the segment an incarnation per slice of `groups` (a new one for all of them) unless
    /// it has them already (never offered: fresh), so that a primary expiring this client costs only its own groups'
    /// slices. Without slices (one group, or more than the header keeps), a segment keeps one
    /// incarnation.
    fn slice(&mut self, groups: u32) {
        if self.memory.slices() == groups || !self.memory.set_slices(groups) {
            return;
        }
        self.desc.incarnation = self.memory.bump_incarnation();
        self.book = SliceBook::new(groups);
    }

    /// The segment as MountSlices carries it (from now on, none of its slices is fresh).
    fn sliced(&mut self) -> SlicedSegment {
        let memory = &self.memory;
        let slices = self.book.offer_once(|r| memory.slice_incarnation(r));
        SlicedSegment { desc: SegmentDesc { incarnation: self.memory.incarnation(), ..self.desc.clone() }, slices }
    }
}

/// The last incarnation of each stable segment this process mounted and let go, by name.
static STABLE_REACHED: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());

impl Drop for Segment {
    /// A stable segment's name may be mounted again by this process: its next memory starts
    /// above what this one reached.
    fn drop(&mut self) {
        if let Some((name, _)) = &self.stable {
            let mut reached = STABLE_REACHED.lock();
            let at = reached.entry(name.clone()).or_insert(0);
            *at = (*at).max(self.desc.incarnation);
        }
    }
}

/// Where the incarnations of a stable segment's new memory start: above any this process
/// reached with the name before, and no lower than the clock in seconds, so that a restart does
/// not repeat the incarnations its earlier run handed out (a run bumps them once per remount,
/// far less often than once a second). Readers check ranges against incarnations, and the
/// masters' generations start over with a new mount.
fn stable_incarnation_start(name: &str) -> u32 {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_secs());
    let before = STABLE_REACHED.lock().get(name).copied().unwrap_or(0);
    (secs as u32).max(before.saturating_add(1)).clamp(1, u32::MAX - 1)
}

/// A 64-bit mix (splitmix64's finalizer): every input bit moves every output bit.
fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The rendezvous seed of `reader` reading `key`.
fn rendezvous_seed(reader: ClientId, key: &str) -> u64 {
    let mut h = mix64(reader.0 as u64 ^ mix64((reader.0 >> 64) as u64));
    for chunk in key.as_bytes().chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = mix64(h ^ u64::from_le_bytes(word));
    }
    mix64(h ^ key.len() as u64)
}

/// The rank of the replica on `segment` for a reader of `seed`: highest first.
fn rendezvous_score(seed: u64, segment: SegmentId) -> u64 {
    mix64(seed ^ mix64(segment.0 as u64 ^ mix64((segment.0 >> 64) as u64)))
}

/// A fresh write id: random, never 0.
fn new_write_id() -> u64 {
    loop {
        let id: u64 = rand::random();
        if id != 0 {
            return id;
        }
    }
}

struct Heartbeat {
    stop: Mutex<bool>,
    wake: Condvar,
}

struct Inner {
    cfg: ClientConfig,
    id: ClientId,
    hostname: String,
    /// One connection pool per master address given; `current` is the one in use.
    masters: Vec<Arc<BlockingClient>>,
    current: std::sync::atomic::AtomicUsize,
    /// How connections to masters authenticate: for those the route table names.
    rpc: RpcConfig,
    /// Connections to group primaries the route table names, by address, beyond `masters`.
    peers: parking_lot::RwLock<HashMap<String, Arc<BlockingClient>>>,
    /// The primaries that have this client's segments under their current incarnation (in a
    /// cluster of several groups): a primary the route table names that is not here gets them
    /// on the next heartbeat.
    mounted_on: Mutex<std::collections::BTreeSet<String>>,
    engine: TransferEngine,
    registry: Arc<SegmentRegistry>,
    segments: Mutex<Vec<Segment>>,
    /// Held while this client's set of segments changes on the masters (a mount, an unmount,
    /// a remount), so that one never interleaves with another: a remount between a mount's
    /// listing and its MountSegment would mount a newer incarnation first. Reentrant, because
    /// a call that finds the client forgotten remounts on the same thread.
    mounts: parking_lot::ReentrantMutex<()>,
    server: Mutex<Option<TransferServer>>,
    registered: Mutex<Vec<(u64, u64)>>,
    /// Replica lists with the leases granted with them, reused while the lease has more than
    /// half its time left (see [`LEASE_REUSE_FRACTION`]).
    leases: Mutex<HashMap<String, Arc<(ReplicaList, Instant)>>>,
    /// Open put sessions (see `sessions.rs`).
    put_sessions: Mutex<sessions::PutSessions>,
    closed: AtomicBool,
    /// The master instance last seen in a heartbeat; a new one means a restarted master.
    master_instance: AtomicU64,
    /// The KVPT groups' epochs and primaries, for the routes of key-addressed requests: the
    /// initial epoch until a master says otherwise; each group's entry only moves forward.
    routes: parking_lot::RwLock<RouteCache>,
    /// The masters' registration lease TTL in milliseconds, as their route tables say (0: not
    /// known, or masters without a cluster): a try's patience is derived from it.
    lease_ttl_ms: AtomicU64,
    heartbeat: Heartbeat,
    /// The task worker (see `tasks.rs`), stopped with the heartbeat.
    task_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The process that connected; a forked child that inherits the client never closes it.
    pid: u32,
}

/// How long an implicit close (the last clone dropped, or a process exiting) may spend on each
/// unmount; it makes one attempt, so a dead master cannot hold up a drop or an exit.
const QUICK_CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A client of a Tycho store. Cheap to clone; clones share one client. Every call runs on the
/// caller's thread. Dropping the last clone closes the client (as Mooncake's destructor does):
/// its segments are unmounted instead of lingering until the master's client TTL.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    heartbeat_thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    _close_on_drop: Arc<CloseOnDrop>,
}

/// Shared by every clone of a [`Client`]; its drop (once, with the last clone) closes the client.
struct CloseOnDrop {
    inner: Arc<Inner>,
    heartbeat_thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let _ = shut_down(&self.inner, &self.heartbeat_thread, true);
    }
}

/// Unmounts the client's segments, stops serving and heartbeating. Idempotent. `quick` (an
/// implicit close) does not wait for the heartbeat thread and tries each unmount once within
/// [`QUICK_CLOSE_TIMEOUT`]; in a forked child it only marks the client closed, leaving the
/// parent's segments alone.
fn shut_down(
    inner: &Inner,
    heartbeat_thread: &Mutex<Option<std::thread::JoinHandle<()>>>,
    quick: bool,
) -> Result<(), ErrorCode> {
    if inner.closed.swap(true, Ordering::AcqRel) {
        return Ok(());
    }
    if quick && std::process::id() != inner.pid {
        return Ok(());
    }
    *inner.heartbeat.stop.lock() = true;
    inner.heartbeat.wake.notify_all();
    let worker = inner.task_thread.lock().take();
    for t in [heartbeat_thread.lock().take(), worker].into_iter().flatten() {
        // A quick close leaves the threads to finish their current call and stop on their own.
        if !quick && t.thread().id() != std::thread::current().id() {
            let _ = t.join();
        }
    }
    // Open put sessions would block their keys until the discard timeout: revoked first.
    sessions::revoke_all(inner, quick);
    let segments: Vec<Segment> = {
        // After any mount in progress (which sees the client closed, or is listed by now).
        let _mounting = inner.mounts.lock();
        std::mem::take(&mut *inner.segments.lock())
    };
    let mut result = Ok(());
    for s in &segments {
        let req = Request::UnmountSegment { client: inner.id, segment: s.desc.id };
        let r = if quick {
            match inner.master().call::<Request, Response>(&req, QUICK_CLOSE_TIMEOUT) {
                Ok(r) if r.error_code().is_some() => Err(r.error_code().unwrap_or(ErrorCode::INTERNAL_ERROR)),
                Ok(_) => Ok(()),
                Err(e) => Err(e.code()),
            }
        } else {
            inner.call(&req).map(|_| ())
        };
        if let Err(e) = r {
            result = Err(e);
        }
        inner.registry.unregister(s.desc.id);
    }
    inner.server.lock().take();
    result
}

fn bind_transfer(hostname: &str) -> Result<(TcpListener, String), ErrorCode> {
    if hostname.contains(':') {
        let l = TcpListener::bind(hostname).map_err(|_| ErrorCode::INVALID_PARAMS)?;
        let port = l.local_addr().map_err(|_| ErrorCode::INTERNAL_ERROR)?.port();
        let host = hostname.rsplit_once(':').map_or(hostname, |(h, _)| h);
        return Ok((l, format!("{host}:{port}")));
    }
    // Start at a random point so that clients started together do not race for one port.
    let span = AUTO_PORT_RANGE.end - AUTO_PORT_RANGE.start;
    let start: u16 = rand::random::<u16>() % span;
    for i in 0..span {
        let port = AUTO_PORT_RANGE.start + (start + i) % span;
        if let Ok(l) = TcpListener::bind((hostname, port)) {
            return Ok((l, format!("{hostname}:{port}")));
        }
    }
    Err(ErrorCode::INTERNAL_ERROR)
}

impl Client {
    /// Connects to the master, creates and mounts this client's segment (if any), starts
    /// serving it and heartbeating.
    pub fn connect(cfg: ClientConfig) -> Result<Client, ErrorCode> {
        let registry = Arc::new(SegmentRegistry::with_serve_rate(cfg.serve_rate));
        let (listener, hostname) = bind_transfer(&cfg.local_hostname)?;
        let addrs = cfg.master_addrs()?;
        if addrs.is_empty() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let plain = RpcConfig { spin: cfg.rpc_spin, auth: cfg.auth.clone(), ..RpcConfig::default() };
        // The first master that answers and serves; with one address, that one as before.
        let (at, first, registered) = {
            let mut last = ErrorCode::RPC_FAIL;
            let mut found = None;
            for (i, addr) in addrs.iter().enumerate() {
                let c = BlockingClient::new(addr, plain.clone());
                if let Err(e) = c.check() {
                    tracing::warn!(master = %addr, error = %e, "cannot reach the master");
                    last = e.code();
                    continue;
                }
                let registered = match c.secret() {
                    None => None,
                    Some(_) => {
                        match call_with_retry(&c, &Request::Register { tenant: cfg.tenant.clone() }, cfg.rpc_timeout) {
                            Ok(Response::Registered { client, credential }) => Some((client, credential)),
                            Ok(_) => return Err(ErrorCode::INTERNAL_ERROR),
                            Err(e) if addrs.len() > 1 => {
                                tracing::warn!(master = %addr, error = %e, "the master does not serve");
                                last = e;
                                continue;
                            }
                            Err(e) => return Err(e),
                        }
                    }
                };
                found = Some((i, c, registered));
                break;
            }
            found.ok_or(last)?
        };
        // Peers prove the secret the master accepted (none if the master asks for none).
        let secret = first.secret();
        // With a secret, the master issues this client's id and credential, and every later
        // connection proves them (to every master of the cluster: they share the secret);
        // without one, the client picks its id.
        let (id, masters, rpc) = match (&secret, registered) {
            (Some(s), Some((client, credential))) => {
                let identity = Identity::Client { client: client.0, tenant: cfg.tenant.clone(), credential };
                let rpc = RpcConfig {
                    spin: cfg.rpc_spin,
                    auth: ClientAuth::Secret(s.clone()),
                    identity: Some(identity.clone()),
                    ..RpcConfig::default()
                };
                let masters: Vec<Arc<BlockingClient>> =
                    addrs.iter().map(|a| Arc::new(BlockingClient::new(a, rpc.clone()))).collect();
                masters[at].check().map_err(|e| e.code())?;
                (client, masters, rpc)
            }
            _ => {
                let mut masters: Vec<Arc<BlockingClient>> =
                    addrs.iter().map(|a| Arc::new(BlockingClient::new(a, plain.clone()))).collect();
                masters[at] = Arc::new(first);
                (ClientId(rand::random()), masters, plain)
            }
        };
        let engine = TransferEngine::new(&cfg.host_id, cfg.protocol == Protocol::Tcp, registry.clone(), secret.clone())
            .with_identity(rpc.identity.clone())
            .with_encryption(cfg.encrypt);
        let mut segments = Vec::new();
        if cfg.segment_size > 0 {
            let size = usize::try_from(cfg.segment_size).map_err(|_| ErrorCode::INVALID_PARAMS)?;
            let memory = Arc::new(Mapping::create("tycho-segment", size).map_err(|e| {
                tracing::error!(error = %e, "cannot create the segment");
                ErrorCode::INTERNAL_ERROR
            })?);
            let id = match &cfg.stable_segment {
                Some(name) => {
                    check_stable_name(name).map_err(|_| ErrorCode::INVALID_PARAMS)?;
                    stable_segment_id(name)
                }
                None => SegmentId(rand::random()),
            };
            let desc = SegmentDesc {
                id,
                name: hostname.clone(),
                base: memory.base(),
                size: cfg.segment_size,
                endpoint: hostname.clone(),
                host: cfg.host_id.clone(),
                incarnation: 0,
            };
            if let Some(name) = &cfg.stable_segment {
                memory.start_incarnations_at(stable_incarnation_start(name));
            }
            registry.register(desc.id, memory.clone());
            let mut segment = Segment::new(desc, memory);
            segment.stable = cfg.stable_segment.clone().map(|name| (name, Medium::Dram));
            segments.push(segment);
        }
        let limits = ServerLimits {
            idle_timeout: cfg.transfer_idle_timeout,
            encrypted_only: cfg.encrypt,
            ..ServerLimits::default()
        };
        let server = TransferServer::serve_with(listener, registry.clone(), secret, limits)
            .map_err(|_| ErrorCode::INTERNAL_ERROR)?;
        let inner = Arc::new(Inner {
            cfg,
            id,
            hostname,
            masters,
            current: std::sync::atomic::AtomicUsize::new(at),
            rpc,
            peers: parking_lot::RwLock::new(HashMap::new()),
            mounted_on: Mutex::new(std::collections::BTreeSet::new()),
            engine,
            registry,
            segments: Mutex::new(segments),
            mounts: parking_lot::ReentrantMutex::new(()),
            server: Mutex::new(Some(server)),
            registered: Mutex::new(Vec::new()),
            leases: Mutex::new(HashMap::new()),
            put_sessions: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            master_instance: AtomicU64::new(0),
            routes: parking_lot::RwLock::new(RouteCache::new()),
            lease_ttl_ms: AtomicU64::new(0),
            pid: std::process::id(),
            heartbeat: Heartbeat { stop: Mutex::new(false), wake: Condvar::new() },
            task_thread: Mutex::new(None),
        });
        // Who serves each group: a cluster of several masters is routed from the start.
        if let Err(e) = inner.refresh_routes() {
            tracing::debug!(error = %e, "no route table yet; routing by epoch alone");
        }
        inner.remount()?;
        let hb = inner.clone();
        let thread = std::thread::Builder::new()
            .name("tycho-heartbeat".into())
            .spawn(move || hb.heartbeat_loop())
            .map_err(|_| ErrorCode::INTERNAL_ERROR)?;
        // A client that holds a segment runs the copy and move tasks of the replicas on it.
        if !inner.segments.lock().is_empty() && !tasks::ensure_worker(&inner) {
            return Err(ErrorCode::INTERNAL_ERROR);
        }
        let heartbeat_thread = Arc::new(Mutex::new(Some(thread)));
        let close = Arc::new(CloseOnDrop { inner: inner.clone(), heartbeat_thread: heartbeat_thread.clone() });
        let client = Client { inner, heartbeat_thread, _close_on_drop: close };
        // A stable segment is named once it is mounted; a client whose name is refused does
        // not start (closed, its segment unmounted).
        let stable: Vec<(SegmentId, String, Medium)> = (client.inner.segments.lock().iter())
            .filter_map(|s| s.stable.clone().map(|(name, medium)| (s.desc.id, name, medium)))
            .collect();
        for (id, name, medium) in stable {
            if let Err(e) = client.inner.name_stable(id, &name, medium) {
                let _ = client.close();
                return Err(e);
            }
        }
        Ok(client)
    }

    /// This client's id.
    pub fn id(&self) -> ClientId {
        self.inner.id
    }

    /// `host:port` of this client's transfer server.
    pub fn hostname(&self) -> &str {
        &self.inner.hostname
    }

    /// Descriptors of the segments this client contributes.
    pub fn segments(&self) -> Vec<SegmentDesc> {
        self.inner.segments.lock().iter().map(|s| s.desc.clone()).collect()
    }

    /// What a process attaching to this client (a `tycho node`) needs to join its store: the
    /// masters' address, the key it proved to them (none for a cluster without
    /// authentication), its host identity and tenant.
    pub fn attach_info(&self) -> crate::attach::AttachInfo {
        let cfg = &self.inner.cfg;
        crate::attach::AttachInfo {
            master_addr: cfg.master_addr.clone(),
            secret: match &self.inner.rpc.auth {
                ClientAuth::Secret(s) => Some(s.clone()),
                _ => None,
            },
            host_id: cfg.host_id.clone(),
            tenant: cfg.tenant.clone(),
        }
    }

    /// Mounts `memory` as one more segment of this client: the store may place replicas in it
    /// from now on, this client's transfer server serves it, and its copy and move tasks run
    /// here. Fails with the master's error (RESOURCE_LIMIT past the master's caps), leaving
    /// nothing mounted.
    pub fn mount_segment(&self, memory: Arc<Mapping>) -> Result<SegmentDesc, ErrorCode> {
        self.mount(memory, None)
    }

    /// [`Client::mount_segment`] as the stable segment `name` on `medium`: its id is derived
    /// from the name (the same after a restart), and the cluster keeps its descriptor, so that
    /// VSegment extents may name it (docs/vsegment.md). Fails INVALID_PARAMS for a name that is
    /// not valid ([`tycho_proto::quota::check_stable_name`]), SEGMENT_ALREADY_EXISTS while a
    /// segment of that name is mounted (by this process, or by one that died and has not
    /// expired yet), or with the error of storing the descriptor, leaving nothing mounted.
    pub fn mount_stable_segment(
        &self,
        memory: Arc<Mapping>,
        name: &str,
        medium: Medium,
    ) -> Result<SegmentDesc, ErrorCode> {
        check_stable_name(name).map_err(|_| ErrorCode::INVALID_PARAMS)?;
        let desc = self.mount(memory, Some((name.to_owned(), medium)))?;
        if let Err(e) = self.inner.name_stable(desc.id, name, medium) {
            if let Err(u) = self.inner.unmount(desc.id) {
                // It serves nothing from here on; a master that kept it drops it at expiry.
                tracing::warn!(segment = name, error = %u, "could not unmount a stable segment whose naming failed");
            }
            return Err(e);
        }
        Ok(desc)
    }

    fn mount(&self, memory: Arc<Mapping>, stable: Option<(String, Medium)>) -> Result<SegmentDesc, ErrorCode> {
        let inner = &self.inner;
        let _mounting = inner.mounts.lock();
        if self.is_closed() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let id = match &stable {
            Some((name, _)) => {
                memory.start_incarnations_at(stable_incarnation_start(name));
                stable_segment_id(name)
            }
            None => SegmentId(rand::random()),
        };
        if inner.segments.lock().iter().any(|s| s.desc.id == id) {
            return Err(ErrorCode::SEGMENT_ALREADY_EXISTS);
        }
        let desc = SegmentDesc {
            id,
            name: inner.hostname.clone(),
            base: memory.base(),
            size: memory.len() as u64,
            endpoint: inner.hostname.clone(),
            host: inner.cfg.host_id.clone(),
            incarnation: memory.bump_incarnation(),
        };
        inner.registry.register(desc.id, memory.clone());
        // Listed before the master hears of it, so that a remount the call itself makes (the
        // master forgot this client) carries it too; the mount of the same incarnation is
        // idempotent.
        let mut segment = Segment::new(desc.clone(), memory);
        segment.stable = stable;
        if let Some(groups) = inner.sliced_groups() {
            segment.slice(groups);
        }
        inner.segments.lock().push(segment);
        if let Err(e) = inner.call(&Request::MountSegment { client: inner.id, segment: desc.clone() }) {
            inner.segments.lock().retain(|s| s.desc.id != desc.id);
            inner.registry.unregister(desc.id);
            // Some primary may have taken it (the call fails only when none did, or the answer
            // was lost): take it back, best effort; the master drops it at expiry otherwise.
            let _ = inner.call(&Request::UnmountSegment { client: inner.id, segment: desc.id });
            return Err(e);
        }
        tasks::ensure_worker(inner);
        Ok(desc)
    }

    /// Unmounts the segment `id` of this client: its replicas are dropped (objects kept only
    /// there are gone) and its memory is let go once no transfer uses it. SEGMENT_NOT_FOUND
    /// for an id that is not one of this client's segments.
    pub fn unmount_segment(&self, id: SegmentId) -> Result<(), ErrorCode> {
        self.inner.unmount(id)
    }

    /// [`Client::unmount_segment`] after `grace`, on a thread of its own; the segment keeps
    /// serving (and taking new objects) until then. A close before that unmounts it at once.
    /// SEGMENT_NOT_FOUND (now) for an id that is not one of this client's segments.
    pub fn unmount_segment_after(&self, id: SegmentId, grace: Duration) -> Result<(), ErrorCode> {
        if !self.inner.segments.lock().iter().any(|s| s.desc.id == id) {
            return Err(ErrorCode::SEGMENT_NOT_FOUND);
        }
        let inner = self.inner.clone();
        let spawned = std::thread::Builder::new().name("tycho-unmount".into()).spawn(move || {
            let deadline = Instant::now() + grace;
            let mut stop = inner.heartbeat.stop.lock();
            while !*stop && Instant::now() < deadline {
                inner.heartbeat.wake.wait_until(&mut stop, deadline);
            }
            if *stop {
                return; // closing: the close unmounts every segment
            }
            drop(stop);
            if let Err(e) = inner.unmount(id) {
                tracing::warn!(segment = %id, error = %e, "a delayed unmount failed");
            }
        });
        spawned.map(drop).map_err(|_| ErrorCode::INTERNAL_ERROR)
    }

    /// How many reads of this client's segments its transfer server has served (reads by peers
    /// that map the segment on the same host are not counted).
    pub fn reads_served(&self) -> u64 {
        self.inner.registry.reads_served()
    }

    /// Whether `close()` was called.
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Whether the master answers.
    pub fn master_reachable(&self) -> bool {
        matches!(self.inner.call(&Request::ServiceReady), Ok(Response::ServiceReady(true)))
    }

    /// Unmounts this client's segments (objects stored only there are dropped), stops serving
    /// and heartbeating. Idempotent.
    pub fn close(&self) -> Result<(), ErrorCode> {
        shut_down(&self.inner, &self.heartbeat_thread, false)
    }

    /// [`Client::close`] for exit paths: one unmount attempt each within a short timeout, no
    /// wait for the heartbeat thread, and nothing at all in a forked child of the process that
    /// connected.
    pub fn close_quickly(&self) -> Result<(), ErrorCode> {
        shut_down(&self.inner, &self.heartbeat_thread, true)
    }

    fn check_open(&self) -> Result<(), ErrorCode> {
        if self.is_closed() {
            return Err(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS);
        }
        Ok(())
    }

    fn key(&self, key: &str) -> KeyRef {
        self.inner.key_ref(key)
    }

    fn tenant(&self) -> String {
        self.inner.cfg.tenant.clone()
    }

    // ---- writes --------------------------------------------------------------------------

    /// Stores `parts` (concatenated) under `key`. With [`WriteMode::Put`] an existing key is
    /// left as it is and the call succeeds.
    pub fn write(
        &self,
        mode: WriteMode,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicateConfig,
    ) -> Result<(), ErrorCode> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total as u64 > self.inner.cfg.staging_buffer_size {
            return Err(ErrorCode::BUFFER_OVERFLOW);
        }
        self.write_unbounded(mode, key, parts, config)
    }

    fn write_unbounded(
        &self,
        mode: WriteMode,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicateConfig,
    ) -> Result<(), ErrorCode> {
        self.check_open()?;
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if total == 0 {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        // Read-your-writes: this client's next get of the key asks the master.
        self.forget_lease(key);
        let write_id = new_write_id();
        let start = WriteStart {
            client: self.inner.id,
            tenant: self.tenant(),
            key: self.key(key),
            size: total,
            config: config.clone(),
            write_id,
        };
        let req = if mode == WriteMode::Put { Request::PutStart(start) } else { Request::UpsertStart(start) };
        let replicas = match self.inner.call(&req) {
            Ok(Response::WriteStarted(r)) => r,
            Err(ErrorCode::OBJECT_ALREADY_EXISTS) if mode == WriteMode::Put => return Ok(()),
            Err(e @ (ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT | ErrorCode::INVALID_WRITE)) => {
                // The start may have reached the master (INVALID_WRITE: a repeat of it raced the
                // first attempt, which stands): revoke it by its id, or the key would stay
                // blocked until the discard timeout. Revoking a write that never started
                // changes nothing.
                let finish = WriteFinish { client: self.inner.id, tenant: self.tenant(), key: self.key(key), write_id };
                let revoke =
                    if mode == WriteMode::Put { Request::PutRevoke(finish) } else { Request::UpsertRevoke(finish) };
                let _ = self.inner.call(&revoke);
                return Err(e);
            }
            Err(e) => return Err(e),
            Ok(_) => return Err(ErrorCode::INTERNAL_ERROR),
        };
        let mut work = Vec::with_capacity(replicas.len() * parts.len());
        for r in &replicas {
            let mut at = 0u64;
            for p in parts.iter().filter(|p| !p.is_empty()) {
                work.push(Part::Write { replica: r, at, src: p });
                at += p.len() as u64;
            }
        }
        let finish = WriteFinish { client: self.inner.id, tenant: self.tenant(), key: self.key(key), write_id };
        if let Err(e) = self.inner.engine.run(work) {
            tracing::warn!(key, error = %e, "write failed; revoking");
            let revoke =
                if mode == WriteMode::Put { Request::PutRevoke(finish) } else { Request::UpsertRevoke(finish) };
            let _ = self.inner.call(&revoke);
            return Err(e.code());
        }
        let end = if mode == WriteMode::Put { Request::PutEnd(finish) } else { Request::UpsertEnd(finish) };
        match self.inner.call(&end)? {
            Response::Committed(replaced) => {
                self.retire(&replaced);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Retires the ranges of values this client's writes replaced, before it reports the
    /// writes done: a reader that starts after that and still holds the old replica list fails
    /// its generation check and asks the master again, so it never sees the replaced value. A
    /// range that cannot be reached cannot be read either; failures are only logged.
    fn retire(&self, replaced: &[ReplicaDesc]) {
        for r in replaced {
            if let Err(e) = self.inner.engine.retire(r) {
                tracing::debug!(segment = %r.segment, error = %e, "could not retire a replaced range");
            }
        }
    }

    /// Put-if-absent of one value.
    pub fn put(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> Result<(), ErrorCode> {
        self.write(WriteMode::Put, key, &[value], config)
    }

    /// Insert-or-replace of one value.
    pub fn upsert(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> Result<(), ErrorCode> {
        self.write(WriteMode::Upsert, key, &[value], config)
    }

    /// Writes many values: one master call to start them all, transfers in parallel, one call
    /// to end them. Returns one result per key, in order.
    pub fn write_batch(
        &self,
        mode: WriteMode,
        items: &[(&str, &[u8])],
        config: &ReplicateConfig,
        bounded: bool,
    ) -> Vec<Result<(), ErrorCode>> {
        let single: Vec<[&[u8]; 1]> = items.iter().map(|(_, v)| [*v]).collect();
        let items: Vec<(&str, &[&[u8]])> = items.iter().zip(&single).map(|((k, _), v)| (*k, &v[..])).collect();
        self.write_batch_parts(mode, &items, config, bounded)
    }

    /// [`Client::write_batch`] where each value is the concatenation of its parts.
    pub fn write_batch_parts(
        &self,
        mode: WriteMode,
        items: &[(&str, &[&[u8]])],
        config: &ReplicateConfig,
        bounded: bool,
    ) -> Vec<Result<(), ErrorCode>> {
        if items.len() > MAX_BATCH_KEYS {
            return items
                .chunks(MAX_BATCH_KEYS)
                .flat_map(|c| self.write_batch_parts(mode, c, config, bounded))
                .collect();
        }
        let n = items.len();
        if let Err(e) = self.check_open() {
            return vec![Err(e); n];
        }
        let mut out: Vec<Result<(), ErrorCode>> = vec![Ok(()); n];
        let mut live: Vec<usize> = Vec::with_capacity(n);
        let sizes: Vec<u64> = items.iter().map(|(_, parts)| parts.iter().map(|p| p.len() as u64).sum()).collect();
        for (i, &size) in sizes.iter().enumerate() {
            if size == 0 {
                out[i] = Err(ErrorCode::INVALID_PARAMS);
            } else if bounded && size > self.inner.cfg.staging_buffer_size {
                out[i] = Err(ErrorCode::BUFFER_OVERFLOW);
            } else {
                live.push(i);
            }
        }
        if live.is_empty() {
            return out;
        }
        for &i in &live {
            self.forget_lease(items[i].0);
        }
        let write_ids: Vec<u64> = (0..n).map(|_| new_write_id()).collect();
        let start = BatchWriteStart {
            client: self.inner.id,
            tenant: self.tenant(),
            items: live.iter().map(|&i| (self.key(items[i].0), sizes[i])).collect(),
            config: config.clone(),
            write_ids: live.iter().map(|&i| write_ids[i]).collect(),
        };
        let req = if mode == WriteMode::Put { Request::BatchPutStart(start) } else { Request::BatchUpsertStart(start) };
        let revoke = |ids: Vec<usize>| {
            if ids.is_empty() {
                return;
            }
            let finish = BatchWriteFinish {
                client: self.inner.id,
                tenant: self.tenant(),
                keys: ids.iter().map(|&i| self.key(items[i].0)).collect(),
                write_ids: ids.iter().map(|&i| write_ids[i]).collect(),
            };
            let req = if mode == WriteMode::Put {
                Request::BatchPutRevoke(finish)
            } else {
                Request::BatchUpsertRevoke(finish)
            };
            let _ = self.inner.call(&req);
        };
        let started = match self.inner.call(&req) {
            Ok(Response::BatchWriteStarted(r)) if r.len() == live.len() => r,
            Ok(_) => return vec![Err(ErrorCode::INTERNAL_ERROR); n],
            Err(e) => {
                // The starts may have reached the master: revoke them by id.
                if matches!(e, ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT) {
                    revoke(live.clone());
                }
                return vec![Err(e); n];
            }
        };
        // A repeated start that raced its first attempt: that attempt's write stands; revoke it.
        revoke(
            live.iter().zip(&started).filter(|(_, r)| **r == Err(ErrorCode::INVALID_WRITE)).map(|(&i, _)| i).collect(),
        );
        let mut to_finish: Vec<usize> = Vec::new();
        let mut work = Vec::new();
        for (&i, res) in live.iter().zip(&started) {
            match res {
                Ok(replicas) => {
                    to_finish.push(i);
                    for r in replicas {
                        work.push((i, r.clone()));
                    }
                }
                Err(ErrorCode::OBJECT_ALREADY_EXISTS) if mode == WriteMode::Put => {}
                Err(e) => out[i] = Err(*e),
            }
        }
        let mut parts: Vec<Part<'_>> = Vec::with_capacity(work.len());
        for (i, r) in &work {
            let mut at = 0u64;
            for src in items[*i].1.iter().filter(|p| !p.is_empty()) {
                parts.push(Part::Write { replica: r, at, src });
                at += src.len() as u64;
            }
        }
        let transfer = self.inner.engine.run(parts);
        let keys: Vec<KeyRef> = to_finish.iter().map(|&i| self.key(items[i].0)).collect();
        let finish = BatchWriteFinish {
            client: self.inner.id,
            tenant: self.tenant(),
            keys,
            write_ids: to_finish.iter().map(|&i| write_ids[i]).collect(),
        };
        let (req, failure) = match transfer {
            Ok(()) => (
                if mode == WriteMode::Put { Request::BatchPutEnd(finish) } else { Request::BatchUpsertEnd(finish) },
                None,
            ),
            Err(e) => (
                if mode == WriteMode::Put {
                    Request::BatchPutRevoke(finish)
                } else {
                    Request::BatchUpsertRevoke(finish)
                },
                Some(e.code()),
            ),
        };
        let ended = self.inner.call(&req);
        for (k, &i) in to_finish.iter().enumerate() {
            out[i] = match (&failure, &ended) {
                (Some(code), _) => Err(*code),
                (None, Ok(Response::BatchCommitted(r))) => match r.get(k) {
                    Some(Ok(replaced)) => {
                        self.retire(replaced);
                        Ok(())
                    }
                    Some(Err(e)) => Err(*e),
                    None => Err(ErrorCode::INTERNAL_ERROR),
                },
                (None, Err(e)) => Err(*e),
                (None, Ok(_)) => Err(ErrorCode::INTERNAL_ERROR),
            };
        }
        out
    }

    // ---- zero-copy -----------------------------------------------------------------------

    /// Registers caller memory for zero-copy calls.
    pub fn register_buffer(&self, addr: u64, len: u64) -> Result<(), ErrorCode> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        self.inner.registered.lock().push((addr, len));
        Ok(())
    }

    /// Forgets a registered buffer; zero-copy calls on it fail afterwards.
    pub fn unregister_buffer(&self, addr: u64) -> Result<(), ErrorCode> {
        let mut reg = self.inner.registered.lock();
        let before = reg.len();
        reg.retain(|(a, _)| *a != addr);
        if reg.len() == before {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        Ok(())
    }

    /// Whether `[addr, addr + len)` lies inside one registered buffer.
    pub fn is_registered(&self, addr: u64, len: u64) -> bool {
        self.inner.registered.lock().iter().any(|&(a, l)| addr >= a && addr.saturating_add(len) <= a + l)
    }

    /// Writes `len` bytes at `addr` (inside a registered buffer) under `key`, with no copy
    /// through any intermediate buffer.
    ///
    /// # Safety
    /// `addr..addr + len` must be readable memory that stays valid for the call.
    pub unsafe fn write_from(
        &self,
        mode: WriteMode,
        key: &str,
        addr: u64,
        len: u64,
        config: &ReplicateConfig,
    ) -> Result<(), ErrorCode> {
        if !self.is_registered(addr, len) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        // SAFETY: the caller vouches for the memory; it lies in a registered buffer.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        self.write_unbounded(mode, key, &[src], config)
    }

    /// Writes the concatenation of `parts` (address, length; each inside a registered buffer)
    /// under `key`, with no intermediate copy.
    ///
    /// # Safety
    /// Every part must be readable memory that stays valid for the call.
    pub unsafe fn write_parts_from(
        &self,
        mode: WriteMode,
        key: &str,
        parts: &[(u64, u64)],
        config: &ReplicateConfig,
    ) -> Result<(), ErrorCode> {
        if parts.iter().any(|&(addr, len)| !self.is_registered(addr, len)) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        // SAFETY: the caller vouches for the memory; every part lies in a registered buffer.
        let srcs: Vec<&[u8]> = parts
            .iter()
            .map(|&(addr, len)| unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) })
            .collect();
        self.write_unbounded(mode, key, &srcs, config)
    }

    /// Reads `key` into `len` bytes at `addr` (inside a registered buffer). Returns the size.
    ///
    /// # Safety
    /// `addr..addr + len` must be writable memory that stays valid for the call and that no
    /// one else accesses meanwhile.
    pub unsafe fn read_into(&self, key: &str, addr: u64, len: u64) -> Result<usize, ErrorCode> {
        if !self.is_registered(addr, len) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        // SAFETY: see the function's contract.
        let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
        self.get_into(key, dst)
    }

    /// How many same-host peers' segments this client has mapped (received over their local
    /// sockets); for diagnostics and tests.
    pub fn peer_mappings(&self) -> usize {
        self.inner.engine.local_mappings()
    }

    // ---- reads ---------------------------------------------------------------------------

    /// Replica order for reading: this process's own, then same host, then the rest.
    fn by_preference<'a>(&self, key: &str, replicas: &'a [ReplicaDesc]) -> Vec<&'a ReplicaDesc> {
        let mut v: Vec<&ReplicaDesc> = replicas.iter().collect();
        if v.len() < 2 {
            return v;
        }
        // Nearest tier first; within a tier, replicas are equivalent, and each reader ranks them
        // by rendezvous hashing of (reader, key, replica): the readers of a hot key spread
        // evenly over its replicas, and a replica's loss moves only its own readers.
        let reader = rendezvous_seed(self.inner.id, key);
        v.sort_by_cached_key(|r| {
            let tier = match self.inner.engine.transport_for(r) {
                Transport::Local => 0u8,
                Transport::SharedMemory => 1,
                Transport::Tcp => 2,
            };
            (tier, std::cmp::Reverse(rendezvous_score(reader, r.segment)))
        });
        v
    }

    /// Where `key` lives. With `reuse`, a list looked up recently may serve (reads only);
    /// without it the master is asked (metadata queries).
    fn replica_list(&self, key: &str, reuse: bool) -> Result<(ReplicaList, Instant), ErrorCode> {
        if reuse && self.inner.cfg.reuse_leases {
            if let Some(hit) = self.inner.leases.lock().get(key) {
                let (list, asked) = &**hit;
                let window = (Duration::from_millis(list.lease_ttl_ms) / LEASE_REUSE_FRACTION).min(MAX_LEASE_REUSE);
                if asked.elapsed() < window {
                    return Ok((list.clone(), *asked));
                }
            }
        }
        let asked = Instant::now();
        let req = Request::GetReplicaList(KeyQuery { tenant: self.tenant(), key: self.key(key) });
        match self.inner.call(&req)? {
            Response::Replicas(l) => {
                if reuse && self.inner.cfg.reuse_leases {
                    let mut leases = self.inner.leases.lock();
                    if leases.len() >= LEASE_CACHE_ENTRIES {
                        leases.clear();
                    }
                    leases.insert(key.to_string(), Arc::new((l.clone(), asked)));
                }
                Ok((l, asked))
            }
            _ => Err(ErrorCode::INTERNAL_ERROR),
        }
    }

    /// Drops the reusable replica list of `key` (after this client changed the key, or a
    /// read through it failed).
    fn forget_lease(&self, key: &str) {
        self.inner.leases.lock().remove(key);
    }

    fn forget_all_leases(&self) {
        self.inner.leases.lock().clear();
    }

    /// Reads `list`'s object into `dst`, trying replicas in order of preference; fails with
    /// LEASE_EXPIRED rather than return bytes read after the lease ran out.
    fn read_replicas(&self, key: &str, list: &ReplicaList, asked: Instant, dst: &mut [u8]) -> Result<usize, ErrorCode> {
        let size = list.size as usize;
        if dst.len() < size {
            return Err(ErrorCode::BUFFER_OVERFLOW);
        }
        let mut last = ErrorCode::REPLICA_NOT_FOUND;
        for r in self.by_preference(key, &list.replicas) {
            match self.inner.engine.read(r, 0, &mut dst[..size]) {
                Ok(()) => {
                    // The lease was granted no earlier than `asked`.
                    if asked.elapsed() > Duration::from_millis(list.lease_ttl_ms) {
                        return Err(ErrorCode::LEASE_EXPIRED);
                    }
                    return Ok(size);
                }
                Err(e) => last = e.code(),
            }
        }
        Err(last)
    }

    /// Finds where `key` lives and takes a read lease; read it with [`Client::read_lookup`]
    /// or [`Client::read_range`] before the lease runs out.
    pub fn lookup(&self, key: &str) -> Result<Lookup, ErrorCode> {
        self.check_open()?;
        let (list, asked) = self.replica_list(key, true)?;
        Ok(Lookup { key: key.to_string(), list, asked })
    }

    /// Finds many keys at once (one master call). One result per key, in order.
    pub fn lookup_batch(&self, keys: &[&str]) -> Vec<Result<Lookup, ErrorCode>> {
        if keys.len() > MAX_BATCH_KEYS {
            return keys.chunks(MAX_BATCH_KEYS).flat_map(|c| self.lookup_batch(c)).collect();
        }
        if let Err(e) = self.check_open() {
            return vec![Err(e); keys.len()];
        }
        let asked = Instant::now();
        let req = Request::BatchGetReplicaList(BatchKeyQuery {
            tenant: self.tenant(),
            keys: keys.iter().map(|k| self.key(k)).collect(),
        });
        match self.inner.call(&req) {
            Ok(Response::BatchReplicas(l)) => {
                l.into_iter().zip(keys).map(|(r, k)| r.map(|list| Lookup { key: k.to_string(), list, asked })).collect()
            }
            Ok(_) => vec![Err(ErrorCode::INTERNAL_ERROR); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Reads the whole object of `lookup` into `dst`; returns its size.
    pub fn read_lookup(&self, lookup: &Lookup, dst: &mut [u8]) -> Result<usize, ErrorCode> {
        let r = self.read_replicas(&lookup.key, &lookup.list, lookup.asked, dst);
        if r.is_err() {
            self.forget_lease(&lookup.key);
        }
        r
    }

    /// Reads `dst.len()` bytes of `lookup`'s object starting at `at`.
    pub fn read_range(&self, lookup: &Lookup, at: u64, dst: &mut [u8]) -> Result<usize, ErrorCode> {
        if at.checked_add(dst.len() as u64).is_none_or(|end| end > lookup.list.size) || dst.is_empty() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let mut last = ErrorCode::REPLICA_NOT_FOUND;
        for r in self.by_preference(&lookup.key, &lookup.list.replicas) {
            match self.inner.engine.read(r, at, dst) {
                Ok(()) => {
                    if lookup.asked.elapsed() > Duration::from_millis(lookup.list.lease_ttl_ms) {
                        return Err(ErrorCode::LEASE_EXPIRED);
                    }
                    return Ok(dst.len());
                }
                Err(e) => last = e.code(),
            }
        }
        Err(last)
    }

    /// Reads many objects into caller buffers, in parallel; one result (size or error) per
    /// key. A buffer smaller than its object gets BUFFER_OVERFLOW.
    pub fn get_batch_into(&self, keys: &[&str], dsts: Vec<&mut [u8]>) -> Vec<Result<usize, ErrorCode>> {
        let lookups = self.lookup_batch(keys);
        self.read_lookups(&lookups, dsts.into_iter().map(|d| vec![d]).collect(), ErrorCode::BUFFER_OVERFLOW)
    }

    /// Reads many objects, each scattered over its buffers in order (the first bytes fill the
    /// first buffer); one result (size or error) per key. Buffers smaller in total than their
    /// object get INVALID_PARAMS, as in Mooncake; room beyond the object is left untouched.
    pub fn get_batch_into_scattered(&self, keys: &[&str], dsts: Vec<Vec<&mut [u8]>>) -> Vec<Result<usize, ErrorCode>> {
        let lookups = self.lookup_batch(keys);
        self.read_lookups(&lookups, dsts, ErrorCode::INVALID_PARAMS)
    }

    /// Reads each found object into its buffers, all transfers in parallel. An object whose
    /// read failed (its replica went away, its range was reused, the lease ran out) is read again
    /// on its own with a fresh lookup, trying every replica; the others keep their result.
    fn read_lookups(
        &self,
        lookups: &[Result<Lookup, ErrorCode>],
        mut dsts: Vec<Vec<&mut [u8]>>,
        too_small: ErrorCode,
    ) -> Vec<Result<usize, ErrorCode>> {
        let mut out: Vec<Result<usize, ErrorCode>> = vec![Ok(0); lookups.len()];
        let mut reading = Vec::new();
        let mut failed = vec![false; lookups.len()];
        {
            let mut parts = Vec::new();
            let mut owner = Vec::new();
            for (i, (l, dst)) in lookups.iter().zip(dsts.iter_mut()).enumerate() {
                let room: u64 = dst.iter().map(|d| d.len() as u64).sum();
                match l {
                    Err(e) => out[i] = Err(*e),
                    Ok(l) if room < l.list.size => out[i] = Err(too_small),
                    Ok(l) => match self.by_preference(&l.key, &l.list.replicas).first() {
                        Some(r) => {
                            owner.extend(scatter(r, l.list.size, dst, &mut parts).map(|_| i));
                            reading.push((i, l.list.size as usize));
                        }
                        None => failed[i] = true,
                    },
                }
            }
            let results = self.inner.engine.run_each(parts);
            for (i, r) in owner.iter().zip(&results) {
                failed[*i] |= r.is_err();
            }
        }
        let asked = lookups.iter().find_map(|l| l.as_ref().ok()).map(|l| (l.asked, l.list.lease_ttl_ms));
        let expired = asked.is_some_and(|(at, ttl)| at.elapsed() > Duration::from_millis(ttl));
        for (i, size) in reading {
            if !failed[i] && !expired {
                out[i] = Ok(size);
                continue;
            }
            let Ok(l) = &lookups[i] else { continue };
            self.forget_lease(&l.key);
            out[i] = match self.replica_list(&l.key, false) {
                Ok((list, asked)) => self.read_scattered(&l.key, &list, asked, &mut dsts[i], too_small),
                Err(e) => Err(e),
            };
        }
        out
    }

    /// Reads `list`'s object scattered over `dst`, trying each replica in order of preference.
    fn read_scattered(
        &self,
        key: &str,
        list: &ReplicaList,
        asked: Instant,
        dst: &mut [&mut [u8]],
        too_small: ErrorCode,
    ) -> Result<usize, ErrorCode> {
        if dst.iter().map(|d| d.len() as u64).sum::<u64>() < list.size {
            return Err(too_small);
        }
        let mut last = ErrorCode::REPLICA_NOT_FOUND;
        for r in self.by_preference(key, &list.replicas) {
            let mut parts = Vec::new();
            scatter(r, list.size, dst, &mut parts).for_each(drop);
            match self.inner.engine.run(parts) {
                Ok(()) if asked.elapsed() > Duration::from_millis(list.lease_ttl_ms) => {
                    return Err(ErrorCode::LEASE_EXPIRED)
                }
                Ok(()) => return Ok(list.size as usize),
                Err(e) => last = e.code(),
            }
        }
        Err(last)
    }

    /// Reads `key` into `dst`; returns its size.
    pub fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<usize, ErrorCode> {
        self.check_open()?;
        self.read_with_retries(key, |list, asked| self.read_replicas(key, list, asked, dst))
    }

    /// Reads `key` into a new buffer.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, ErrorCode> {
        self.check_open()?;
        let mut buf = Vec::new();
        self.read_with_retries(key, |list, asked| {
            buf.resize(list.size as usize, 0);
            self.read_replicas(key, list, asked, &mut buf)
        })?;
        Ok(buf)
    }

    /// Runs `read` against `key`'s replica list (a reused one first). A failed read (a replica
    /// gone, its range reused by a newer write, the lease run out) asks the master again and
    /// retries, up to [`READ_ATTEMPTS`] in all; a buffer too small is final.
    fn read_with_retries(
        &self,
        key: &str,
        mut read: impl FnMut(&ReplicaList, Instant) -> Result<usize, ErrorCode>,
    ) -> Result<usize, ErrorCode> {
        let (mut list, mut asked) = self.replica_list(key, true)?;
        let mut attempt = 1;
        loop {
            match read(&list, asked) {
                Err(e) if e != ErrorCode::BUFFER_OVERFLOW && attempt < READ_ATTEMPTS => {
                    self.forget_lease(key);
                    (list, asked) = self.replica_list(key, false)?;
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    /// Reads many keys; reads run in parallel. One result per key, in order.
    pub fn get_batch(&self, keys: &[&str]) -> Vec<Result<Vec<u8>, ErrorCode>> {
        let lookups = self.lookup_batch(keys);
        let mut bufs: Vec<Vec<u8>> =
            lookups.iter().map(|l| l.as_ref().map_or(Vec::new(), |l| vec![0u8; l.size() as usize])).collect();
        let dsts = bufs.iter_mut().map(|b| vec![b.as_mut_slice()]).collect();
        let sizes = self.read_lookups(&lookups, dsts, ErrorCode::BUFFER_OVERFLOW);
        sizes.into_iter().zip(bufs).map(|(r, buf)| r.map(|_| buf)).collect()
    }

    /// Size of `key`'s value.
    pub fn size(&self, key: &str) -> Result<u64, ErrorCode> {
        self.check_open()?;
        Ok(self.replica_list(key, false)?.0.size)
    }

    /// Replica descriptors of `key`.
    pub fn replicas(&self, key: &str) -> Result<Vec<ReplicaDesc>, ErrorCode> {
        self.check_open()?;
        Ok(self.replica_list(key, false)?.0.replicas)
    }

    /// Whether `key` holds a complete value.
    pub fn exists(&self, key: &str) -> Result<bool, ErrorCode> {
        self.check_open()?;
        match self.inner.call(&Request::ExistKey(KeyQuery { tenant: self.tenant(), key: self.key(key) }))? {
            Response::Exists(b) => Ok(b),
            _ => Err(ErrorCode::INTERNAL_ERROR),
        }
    }

    /// Existence of many keys.
    pub fn exists_batch(&self, keys: &[&str]) -> Vec<Result<bool, ErrorCode>> {
        if keys.len() > MAX_BATCH_KEYS {
            return keys.chunks(MAX_BATCH_KEYS).flat_map(|c| self.exists_batch(c)).collect();
        }
        if let Err(e) = self.check_open() {
            return vec![Err(e); keys.len()];
        }
        let req = Request::BatchExistKey(BatchKeyQuery {
            tenant: self.tenant(),
            keys: keys.iter().map(|k| self.key(k)).collect(),
        });
        match self.inner.call(&req) {
            Ok(Response::BatchExists(r)) => r,
            Ok(_) => vec![Err(ErrorCode::INTERNAL_ERROR); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    // ---- removal -------------------------------------------------------------------------

    /// Removes `key`; a leased object only with `force`.
    pub fn remove(&self, key: &str, force: bool) -> Result<(), ErrorCode> {
        self.check_open()?;
        self.forget_lease(key);
        self.inner.call(&Request::Remove(RemoveKey { tenant: self.tenant(), key: self.key(key), force })).map(|_| ())
    }

    /// Removes many keys.
    pub fn remove_batch(&self, keys: &[&str], force: bool) -> Vec<Result<(), ErrorCode>> {
        if keys.len() > MAX_BATCH_KEYS {
            return keys.chunks(MAX_BATCH_KEYS).flat_map(|c| self.remove_batch(c, force)).collect();
        }
        if let Err(e) = self.check_open() {
            return vec![Err(e); keys.len()];
        }
        keys.iter().for_each(|k| self.forget_lease(k));
        let req = Request::BatchRemove(BatchRemoveKeys {
            tenant: self.tenant(),
            keys: keys.iter().map(|k| self.key(k)).collect(),
            force,
        });
        match self.inner.call(&req) {
            Ok(Response::BatchDone(r)) => r,
            Ok(_) => vec![Err(ErrorCode::INTERNAL_ERROR); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Drops the replicas of objects this client wrote whose read lease has ended: whole objects,
    /// or only their replicas on `segment` (a segment name, `host:port`) when it is not empty.
    /// One result per key: Ok when cleared, otherwise why not.
    pub fn replica_clear(&self, keys: &[&str], segment: &str) -> Vec<Result<(), ErrorCode>> {
        if keys.len() > MAX_BATCH_KEYS {
            return keys.chunks(MAX_BATCH_KEYS).flat_map(|c| self.replica_clear(c, segment)).collect();
        }
        if let Err(e) = self.check_open() {
            return vec![Err(e); keys.len()];
        }
        keys.iter().for_each(|k| self.forget_lease(k));
        let req = Request::BatchReplicaClear(ReplicaClear {
            client: self.inner.id,
            tenant: self.tenant(),
            keys: keys.iter().map(|k| self.key(k)).collect(),
            segment: segment.to_string(),
        });
        match self.inner.call(&req) {
            Ok(Response::BatchDone(r)) if r.len() == keys.len() => r,
            Ok(_) => vec![Err(ErrorCode::INTERNAL_ERROR); keys.len()],
            Err(e) => vec![Err(e); keys.len()],
        }
    }

    /// Removes every key of this client's tenant matching `regex`, at every primary; the count.
    /// A primary that fails does not stop the others: the error says what they removed, which
    /// primaries did it, and which failed.
    pub fn remove_by_regex(&self, regex: &str, force: bool) -> Result<u64, PartialRemoval> {
        self.check_open().map_err(PartialRemoval::nothing)?;
        self.forget_all_leases();
        self.inner.remove_everywhere(&Request::RemoveByRegex { tenant: self.tenant(), regex: regex.to_string(), force })
    }

    /// Removes every object, at every primary; the count (see
    /// [`remove_by_regex`](Self::remove_by_regex) for a primary that fails).
    pub fn remove_all(&self, force: bool) -> Result<u64, PartialRemoval> {
        self.check_open().map_err(PartialRemoval::nothing)?;
        self.forget_all_leases();
        self.inner.remove_everywhere(&Request::RemoveAll { force })
    }

    /// Any master call. Stats and the key and segment listings answer for the whole cluster
    /// (every primary's answer combined, as [`crate::aggregate`] says; an error if a primary
    /// fails); RemoveAll and RemoveByRegex go to every primary (the first error if one fails,
    /// after all were tried).
    pub fn call(&self, req: &Request) -> Result<Response, ErrorCode> {
        self.inner.call(req)
    }
}

/// The whole cluster's answer to `req` (Stats, ListSegments, ListKeys) from every primary's.
fn merge(req: &Request, answers: Vec<Response>) -> Result<Response, ErrorCode> {
    use crate::aggregate::{merge_keys, merge_segments, merge_stats};
    let bad = || ErrorCode::INTERNAL_ERROR;
    Ok(match req {
        Request::Stats => Response::Stats(merge_stats(
            answers
                .into_iter()
                .map(|a| if let Response::Stats(s) = a { Ok(s) } else { Err(bad()) })
                .collect::<Result<Vec<_>, _>>()?,
        )),
        Request::ListSegments => Response::Segments(merge_segments(
            answers
                .into_iter()
                .map(|a| if let Response::Segments(s) = a { Ok(s) } else { Err(bad()) })
                .collect::<Result<Vec<_>, _>>()?,
        )),
        Request::ListKeys { limit, .. } => Response::Keys(merge_keys(
            answers
                .into_iter()
                .map(|a| if let Response::Keys(k) = a { Ok(k) } else { Err(bad()) })
                .collect::<Result<Vec<_>, _>>()?,
            u64::from(*limit),
        )),
        _ => return Err(bad()),
    })
}

/// Adds to `parts` the reads of `size` bytes of replica `r` into the buffers `dst`, in order;
/// yields one item per part added.
fn scatter<'a, 'b>(
    r: &'a ReplicaDesc,
    size: u64,
    dst: &'b mut [&mut [u8]],
    parts: &mut Vec<Part<'b>>,
) -> impl Iterator<Item = ()>
where
    'a: 'b,
{
    let size = size as usize;
    let mut at = 0usize;
    let before = parts.len();
    for d in dst.iter_mut() {
        let n = d.len().min(size - at);
        if n > 0 {
            parts.push(Part::Read { replica: r, at: at as u64, dst: &mut d[..n] });
        }
        at += n;
    }
    std::iter::repeat_n((), parts.len() - before)
}

/// Whether a batch answer refused every key for a stale epoch.
fn all_stale(resp: &Response) -> bool {
    fn all<T>(v: &[WireResult<T>]) -> bool {
        !v.is_empty() && v.iter().all(|r| matches!(r, Err(ErrorCode::STALE_EPOCH)))
    }
    match resp {
        Response::BatchWriteStarted(v) | Response::BatchCommitted(v) => all(v),
        Response::BatchDone(v) => all(v),
        Response::BatchReplicas(v) => all(v),
        Response::BatchExists(v) => all(v),
        _ => false,
    }
}

/// How long a client keeps looking for a serving master among its addresses (a failover
/// takes the old primary's lease TTL, 5 s by default, plus the standby's catch-up), and waits
/// for one that answers KVPT_MIGRATING (a group about to be served there) to serve it.
const FAILOVER_WAIT: Duration = Duration::from_secs(15);

/// The least patience with one try at a master in a cluster (see [`Inner::patience`]).
const MIN_TRY: Duration = Duration::from_millis(200);

/// Added to a try's patience per key of a batch (an 8192-key batch: 0.8 s more).
const TRY_PER_KEY: Duration = Duration::from_micros(100);

/// Upper bound of the random pause before a route refresh, in microseconds.
const REROUTE_JITTER_US: u64 = 20_000;

/// One try of `req` at `m`, no retry: the answer, or `None` on any failure.
fn call_patiently_once(m: &BlockingClient, req: &Request, p: Patience) -> Option<Response> {
    m.call_within::<Request, Response>(req, p.first_byte, p.whole).ok()
}

/// Whether `code` says the master in use does not serve (any more): try the next address.
fn elsewhere(code: ErrorCode) -> bool {
    matches!(code, ErrorCode::KVPT_NOT_OWNED | ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT)
}

impl Inner {
    /// `key` with the route this client knows for it.
    fn key_ref(&self, key: &str) -> KeyRef {
        let mut route = tycho_routing::route_for(&self.cfg.tenant, key, tycho_routing::INITIAL_GROUP_EPOCH);
        route.epoch = self.routes.read().epoch_of(route.partition_id);
        KeyRef { key: key.to_string(), route }
    }

    /// The master connection in use.
    fn master(&self) -> &BlockingClient {
        &self.masters[self.current.load(Ordering::Acquire) % self.masters.len()]
    }

    /// Calls the masters `req` concerns. In a cluster of several groups whose route table names
    /// their primaries, see [`Inner::call_routed`]; otherwise the master in use (see
    /// [`Inner::call_seeds`]).
    fn call(&self, req: &Request) -> Result<Response, ErrorCode> {
        if self.routes.read().partitioned() {
            return self.call_routed(req);
        }
        self.call_seeds(req)
    }

    /// Calls the master in use; when it does not serve (a standby, a dead or stopped primary),
    /// moves through the other addresses, with back-off, for up to [`FAILOVER_WAIT`]. With one
    /// address it waits the same way while that address answers KVPT_NOT_OWNED (a standby
    /// behind a name that service discovery moves). Requests whose repetition is not harmless
    /// are not sent again after a lost answer.
    fn call_seeds(&self, req: &Request) -> Result<Response, ErrorCode> {
        let deadline = Instant::now() + FAILOVER_WAIT;
        let mut pause = Duration::from_millis(50);
        loop {
            let used = self.current.load(Ordering::Acquire);
            match self.call_here(req) {
                // The group is about to be served there (a promotion replaying the log's end):
                // the same master again, after a pause.
                Err(ErrorCode::KVPT_MIGRATING) if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                // A standby's refusal always; a lost connection only with other addresses to try
                // (a single master that is down fails as fast as before), and only for requests
                // that may be sent twice.
                Err(code)
                    if elsewhere(code)
                        && (code == ErrorCode::KVPT_NOT_OWNED
                            || (self.masters.len() > 1 && crate::retry::is_idempotent(req))) =>
                {
                    if Instant::now() >= deadline {
                        return Err(code);
                    }
                    let next = (used + 1) % self.masters.len();
                    if self.current.compare_exchange(used, next, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                        tracing::info!(from = self.masters[used].addr(), to = self.masters[next].addr(), error = ?code, "trying another master");
                    }
                    if next == 0 || self.masters.len() == 1 {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(Duration::from_millis(500));
                    }
                }
                r => return r,
            }
        }
    }

    fn call_here(&self, req: &Request) -> Result<Response, ErrorCode> {
        match call_patiently(self.master(), req, self.patience(req)) {
            // The master forgot us (it restarted, or expired us while we were paused): register
            // again with every segment, then retry once, instead of waiting for the heartbeat.
            Err(ErrorCode::CLIENT_NOT_FOUND) if !matches!(req, Request::ReMountSegment { .. }) => {
                self.engine.forget_mappings();
                self.remount()?;
                call_patiently(self.master(), req, self.patience(req))
            }
            // A group changed owner (a failover): learn the epochs, route again, retry once.
            // A batch says so per key (with one group, for every key, and nothing was done).
            Ok(resp) if !all_stale(&resp) => Ok(resp),
            Ok(_) | Err(ErrorCode::STALE_EPOCH) => {
                self.refresh_routes()?;
                call_patiently(self.master(), &self.retag(req), self.patience(req))
            }
            r => r,
        }
    }

    /// Asks the master in use for the groups' epochs and primaries.
    fn refresh_routes(&self) -> Result<(), ErrorCode> {
        self.refresh_routes_from(self.master())
    }

    /// Asks `master` for the groups' epochs and primaries.
    fn refresh_routes_from(&self, master: &BlockingClient) -> Result<(), ErrorCode> {
        match call_patiently(master, &Request::Routes, self.patience(&Request::Routes))? {
            Response::Routes(t) => {
                self.learn_routes(&t);
                Ok(())
            }
            _ => Err(ErrorCode::INTERNAL_ERROR),
        }
    }

    /// How long one try of `req` may take at one master. With masters in a cluster, an
    /// idempotent call gets a fifth of their lease TTL (at least [`MIN_TRY`]) for its
    /// connection and first byte, plus [`TRY_PER_KEY`] per key of a batch: a stopped or hung
    /// primary is given up on well before its successor takes over, while a long batch keeps
    /// its time. The whole call keeps `rpc_timeout`, and so does every call that may not be
    /// sent twice (its outcome would be unknown).
    fn patience(&self, req: &Request) -> Patience {
        let whole = self.cfg.rpc_timeout;
        let ttl = self.lease_ttl_ms.load(Ordering::Relaxed);
        if ttl == 0 || !crate::retry::is_idempotent(req) {
            return Patience::whole(whole);
        }
        let keys = u32::try_from(req.batch_len()).unwrap_or(u32::MAX);
        let first_byte = (Duration::from_millis(ttl) / 5).max(MIN_TRY) + TRY_PER_KEY.saturating_mul(keys);
        Patience { first_byte: first_byte.min(whole), whole }
    }

    /// Asks for the route table again after `failed` (a master) answered a routing error or
    /// none: one master chosen at random among the addresses given and the primaries the
    /// table names, after a short random pause (clients that lost the same primary do not all
    /// ask the same master at once), then the next, `failed` last, until one answers. One
    /// try each: the callers retry.
    fn reroute(&self, failed: &BlockingClient) {
        let ask = |m: &BlockingClient| match call_patiently_once(m, &Request::Routes, self.patience(&Request::Routes)) {
            Some(Response::Routes(t)) => {
                self.learn_routes(&t);
                true
            }
            _ => false,
        };
        std::thread::sleep(Duration::from_micros(rand::random::<u64>() % REROUTE_JITTER_US));
        let mut others: Vec<Arc<BlockingClient>> = Vec::new();
        for m in self.masters.iter().cloned().chain(self.owners().iter().map(|o| self.conn(o))) {
            if m.addr() != failed.addr() && !others.iter().any(|o| o.addr() == m.addr()) {
                others.push(m);
            }
        }
        // (Fisher–Yates.)
        for i in (1..others.len()).rev() {
            others.swap(i, rand::random::<u64>() as usize % (i + 1));
        }
        if others.iter().any(|m| ask(m)) {
            return;
        }
        ask(failed);
    }

    /// The connection to the master at `addr` ("": the master in use).
    fn conn(&self, addr: &str) -> Arc<BlockingClient> {
        if addr.is_empty() {
            return self.masters[self.current.load(Ordering::Acquire) % self.masters.len()].clone();
        }
        if let Some(m) = self.masters.iter().find(|m| m.addr() == addr) {
            return m.clone();
        }
        if let Some(p) = self.peers.read().get(addr) {
            return p.clone();
        }
        self.peers
            .write()
            .entry(addr.to_string())
            .or_insert_with(|| Arc::new(BlockingClient::new(addr, self.rpc.clone())))
            .clone()
    }

    /// Learns a route table a master answered (entries older than the cache's are ignored).
    fn learn_routes(&self, t: &RouteTable) {
        if t.lease_ttl_ms > 0 {
            self.lease_ttl_ms.store(t.lease_ttl_ms, Ordering::Relaxed);
        }
        if self.routes.write().learn(t) {
            tracing::debug!(epochs = ?t.epochs, owners = ?t.owners, "routes refreshed");
        }
    }

    /// The address of the primary of `partition`'s group as the route table says ("": unknown).
    fn owner_of(&self, partition: u16) -> String {
        self.routes.read().owner_of(partition).to_string()
    }

    /// Every group primary the route table names, each once.
    fn owners(&self) -> Vec<String> {
        self.routes.read().owners()
    }

    /// `req` with every key's epoch set from the route table.
    fn retag(&self, req: &Request) -> Request {
        let mut again = req.clone();
        let routes = self.routes.read();
        for r in again.routes_mut() {
            r.epoch = routes.epoch_of(r.partition_id);
        }
        again
    }

    /// Calls the primaries `req` concerns, by the route table: a key's request goes to its
    /// group's primary; a batch's keys to theirs, one request per primary, with the per-key
    /// answers put back in order (a primary that fails fails its keys only); RemoveAll and
    /// RemoveByRegex to every primary (the counts added up); a heartbeat and a segment's
    /// mount or unmount to every primary; anything else to the master in use. Routing errors
    /// are followed as spec 03 says: KVPT_NOT_OWNED and STALE_EPOCH refresh the route table and
    /// go to the owner it names; a lost connection is retried (when the request may be sent
    /// twice) with back-off, and refreshes the route table from another master. All within
    /// [`FAILOVER_WAIT`].
    fn call_routed(&self, req: &Request) -> Result<Response, ErrorCode> {
        let n = req.batch_len();
        if n > 0 {
            return self.call_batch(req, n);
        }
        if let Some(&partition) = req.partitions().first() {
            return self.call_owner(req, partition);
        }
        match req {
            Request::RemoveAll { .. } | Request::RemoveByRegex { .. } => {
                self.remove_everywhere(req).map(Response::Removed).map_err(|p| p.code())
            }
            Request::Stats | Request::ListSegments | Request::ListKeys { .. } => {
                let mut answers = Vec::new();
                for (owner, answer) in self.call_each_primary(req) {
                    match answer {
                        Ok(a) => answers.push(a),
                        Err(e) => {
                            tracing::warn!(master = %owner, error = %e, "a primary did not answer; no whole-cluster answer");
                            return Err(e);
                        }
                    }
                }
                merge(req, answers)
            }
            Request::Ping { .. } => self.ping_every_primary(req),
            // Each primary hands out the tasks of its groups.
            Request::FetchTasks { .. } => {
                let mut all = Vec::new();
                for owner in self.owners() {
                    match call_patiently(&self.conn(&owner), req, self.patience(req)) {
                        Ok(Response::Tasks(t)) => all.extend(t),
                        Ok(_) => return Err(ErrorCode::INTERNAL_ERROR),
                        Err(e) => tracing::debug!(master = %owner, error = %e, "could not fetch tasks"),
                    }
                }
                Ok(Response::Tasks(all))
            }
            Request::MountSegment { .. } | Request::ReMountSegment { .. } | Request::UnmountSegment { .. } => {
                // Every primary allocates on this client's segments and expires it on its own.
                // A primary that fails a (re)mount gets it again on a later heartbeat; the call
                // succeeds once one primary has it.
                // When none took it because the groups were changing hands (a claim under way:
                // the primary's log for the moving group ends), the route table again, and
                // again, within [`FAILOVER_WAIT`].
                let remount = matches!(req, Request::ReMountSegment { .. });
                // Segments with an incarnation per slice are (re)mounted whole at each primary
                // with MountSlices, which carries them all.
                let sliced = !matches!(req, Request::UnmountSegment { .. }) && self.sliced_groups().is_some();
                let deadline = Instant::now() + FAILOVER_WAIT;
                let mut pause = Duration::from_millis(50);
                loop {
                    let mut first_error = None;
                    let mut done = false;
                    for owner in self.owners() {
                        let answer = if sliced {
                            self.mount_slices_at(&owner).map(|()| Response::Done)
                        } else {
                            call_patiently(&self.conn(&owner), req, self.patience(req))
                        };
                        match answer {
                            Ok(_) => {
                                done = true;
                                if remount {
                                    self.mounted_on.lock().insert(owner);
                                }
                            }
                            Err(e) => {
                                tracing::warn!(master = %owner, error = %e, "a primary did not take this client's segments; retrying on the next heartbeat");
                                first_error.get_or_insert(e);
                            }
                        }
                    }
                    match (done, first_error) {
                        (false, Some(e))
                            if matches!(
                                e,
                                ErrorCode::KVPT_NOT_OWNED | ErrorCode::STALE_EPOCH | ErrorCode::KVPT_MIGRATING
                            ) && Instant::now() < deadline =>
                        {
                            self.reroute(&self.conn(""));
                            std::thread::sleep(pause);
                            pause = (pause * 2).min(Duration::from_millis(500));
                        }
                        (false, Some(e)) => return Err(e),
                        _ => return Ok(Response::Done),
                    }
                }
            }
            _ => self.call_seeds(req),
        }
    }

    /// `req` at every primary the route table names, each answer or failure with its primary:
    /// a failure at one does not stop the others.
    fn call_each_primary(&self, req: &Request) -> Vec<(String, Result<Response, ErrorCode>)> {
        self.owners()
            .into_iter()
            .map(|owner| {
                let answer = call_patiently(&self.conn(&owner), req, self.patience(req));
                (owner, answer)
            })
            .collect()
    }

    /// A RemoveAll or RemoveByRegex at every primary (at the master in use when the cluster is
    /// not partitioned); the count, or what was done where some primary failed.
    fn remove_everywhere(&self, req: &Request) -> Result<u64, PartialRemoval> {
        let answers = if self.routes.read().partitioned() {
            self.call_each_primary(req)
        } else {
            vec![(self.conn("").addr().to_string(), self.call_seeds(req))]
        };
        let mut report = PartialRemoval { removed: 0, done: Vec::new(), failed: Vec::new() };
        for (owner, answer) in answers {
            match answer {
                Ok(Response::Removed(n)) => {
                    report.removed += n;
                    report.done.push(owner);
                }
                Ok(_) => report.failed.push((owner, ErrorCode::INTERNAL_ERROR)),
                Err(e) => {
                    tracing::warn!(master = %owner, error = %e, "a primary did not remove");
                    report.failed.push((owner, e));
                }
            }
        }
        if report.failed.is_empty() {
            Ok(report.removed)
        } else {
            Err(report)
        }
    }

    /// Pings every primary at once (one attempt each, so that a hung one delays none of the
    /// others past their client TTL); NeedRemount if any asks for it. First mounts this
    /// client's segments on primaries that do not have them yet (a new owner, one a remount
    /// missed).
    fn ping_every_primary(&self, req: &Request) -> Result<Response, ErrorCode> {
        let owners = self.owners();
        let missing: Vec<String> = {
            let mounted = self.mounted_on.lock();
            owners.iter().filter(|o| !mounted.contains(*o)).cloned().collect()
        };
        if !missing.is_empty() {
            let _mounting = self.mounts.lock();
            let segments: Vec<SegmentDesc> = self.segments.lock().iter().map(|s| s.desc.clone()).collect();
            let again = Request::ReMountSegment { client: self.id, segments };
            let sliced = self.sliced_groups().is_some();
            for owner in missing {
                if sliced {
                    if let Err(e) = self.mount_slices_at(&owner) {
                        tracing::debug!(master = %owner, error = %e, "could not mount on a primary; will retry");
                    }
                    continue;
                }
                match self.conn(&owner).call::<Request, Response>(&again, self.cfg.rpc_timeout) {
                    Ok(Response::Done) => {
                        self.mounted_on.lock().insert(owner);
                    }
                    r => tracing::debug!(master = %owner, answer = ?r, "could not mount on a primary; will retry"),
                }
            }
        }
        // Tests cut this client off from one master (`return(host:port)`, for as many beats as
        // the failpoint's count says): its pings there are lost.
        #[cfg(feature = "failpoints")]
        let cut_off: Option<String> = fail::eval("client::drop_pings_to", |to| to).flatten();
        #[cfg(not(feature = "failpoints"))]
        let cut_off: Option<String> = None;
        let answers: Vec<Result<Response, ErrorCode>> = std::thread::scope(|s| {
            let calls: Vec<_> = owners
                .iter()
                .map(|owner| {
                    let conn = self.conn(owner);
                    let lost = cut_off.as_deref() == Some(owner.as_str());
                    s.spawn(move || {
                        if lost {
                            return Err(ErrorCode::RPC_TIMEOUT);
                        }
                        match conn.call::<Request, Response>(req, self.cfg.rpc_timeout) {
                            Ok(r) if r.error_code().is_some() => {
                                Err(r.error_code().unwrap_or(ErrorCode::INTERNAL_ERROR))
                            }
                            Ok(r) => Ok(r),
                            Err(e) => Err(e.code()),
                        }
                    })
                })
                .collect();
            calls.into_iter().map(|c| c.join().unwrap_or(Err(ErrorCode::INTERNAL_ERROR))).collect()
        });
        let remount = PingReply { status: ClientStatus::NeedRemount, master_instance: 0 };
        let mut last = Err(ErrorCode::RPC_FAIL);
        for a in answers {
            match a {
                Ok(Response::Ping(p)) if p.status == ClientStatus::NeedRemount => return Ok(Response::Ping(p)),
                Err(ErrorCode::CLIENT_NOT_FOUND) => return Ok(Response::Ping(remount)),
                Ok(r) => last = Ok(r),
                Err(e) if last.is_err() => last = Err(e),
                Err(_) => {}
            }
        }
        last
    }

    /// One key's request at its group's primary (see [`Inner::call_routed`]).
    fn call_owner(&self, req: &Request, partition: u16) -> Result<Response, ErrorCode> {
        let deadline = Instant::now() + FAILOVER_WAIT;
        let mut pause = Duration::from_millis(20);
        let mut req = std::borrow::Cow::Borrowed(req);
        let mut remounted = false;
        loop {
            let owner = self.owner_of(partition);
            let conn = self.conn(&owner);
            // A refusal naming the owner is noted in the route cache (when it is newer).
            let learn = |r: &Redirect| {
                if self.routes.write().note(r.group, r.epoch, &r.owner) {
                    tracing::debug!(group = r.group, epoch = r.epoch, owner = %r.owner, "redirected");
                }
            };
            let code = match call_noting(&conn, &req, self.patience(&req), learn) {
                Err(ErrorCode::CLIENT_NOT_FOUND) if !remounted => {
                    remounted = true;
                    self.engine.forget_mappings();
                    self.remount()?;
                    continue;
                }
                Err(code @ (ErrorCode::KVPT_NOT_OWNED | ErrorCode::STALE_EPOCH | ErrorCode::KVPT_MIGRATING)) => code,
                Err(code @ (ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT)) if crate::retry::is_idempotent(&req) => code,
                r => return r,
            };
            if Instant::now() >= deadline {
                return Err(code);
            }
            // Redirected to another primary: at once. Else the route table again, and the same
            // one (its group is moving, or the records have not caught up): after a pause.
            if self.owner_of(partition) == owner {
                self.reroute(&conn);
            }
            if self.owner_of(partition) == owner {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            req = std::borrow::Cow::Owned(self.retag(&req));
        }
    }

    /// A batch, split by primary (see [`Inner::call_routed`]). Keys refused for their route are
    /// sent again, alone, once the route table was refreshed.
    fn call_batch(&self, req: &Request, n: usize) -> Result<Response, ErrorCode> {
        let deadline = Instant::now() + FAILOVER_WAIT;
        let mut pause = Duration::from_millis(20);
        let mut req = req.clone();
        let mut parts: Vec<(Vec<usize>, Response)> = Vec::new();
        let mut todo: Vec<usize> = (0..n).collect();
        loop {
            let partitions = req.partitions();
            let mut by_owner: Vec<(String, Vec<usize>)> = Vec::new();
            for &i in &todo {
                let owner = self.owner_of(partitions[i]);
                match by_owner.iter_mut().find(|(o, _)| *o == owner) {
                    Some((_, at)) => at.push(i),
                    None => by_owner.push((owner, vec![i])),
                }
            }
            let mut again = Vec::new();
            let mut failed = Vec::new();
            // Where the keys to send again went this round.
            let mut sent_to: Vec<String> = Vec::new();
            // Refusals that name their groups' owners are noted in the route cache.
            let learn = |r: &Redirect| {
                if self.routes.write().note(r.group, r.epoch, &r.owner) {
                    tracing::debug!(group = r.group, epoch = r.epoch, owner = %r.owner, "batch keys redirected");
                }
            };
            for (owner, at) in by_owner {
                let conn = self.conn(&owner);
                let sub = req.subset(&at).ok_or(ErrorCode::INTERNAL_ERROR)?;
                let resp = call_noting(&conn, &sub, self.patience(&sub), learn).unwrap_or_else(Response::Error);
                let routing = |c: &ErrorCode| {
                    matches!(c, ErrorCode::KVPT_NOT_OWNED | ErrorCode::STALE_EPOCH | ErrorCode::KVPT_MIGRATING)
                        || (matches!(c, ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT)
                            && crate::retry::is_idempotent(&req))
                };
                let retry: Vec<usize> = match &resp {
                    Response::Error(c) if routing(c) => at.clone(),
                    r => match r.batch_errors() {
                        Some(errors) => at
                            .iter()
                            .zip(errors)
                            .filter(|(_, e)| e.as_ref().is_some_and(routing))
                            .map(|(&i, _)| i)
                            .collect(),
                        None => Vec::new(),
                    },
                };
                if !retry.is_empty() {
                    failed.push(conn);
                }
                sent_to.extend(retry.iter().map(|_| owner.clone()));
                again.extend(retry);
                parts.push((at, resp));
            }
            if again.is_empty() || Instant::now() >= deadline {
                // Every part failed as a whole: the batch did, with that part's code.
                let whole: Vec<ErrorCode> = parts
                    .iter()
                    .filter_map(|(_, r)| match r {
                        Response::Error(c) => Some(*c),
                        _ => None,
                    })
                    .collect();
                if let (true, Some(&code)) = (whole.len() == parts.len(), whole.last()) {
                    return Err(code);
                }
                return Response::merge_batch(n, parts).ok_or(ErrorCode::INTERNAL_ERROR);
            }
            // Owners named with the refusals moved their keys already: no route refresh then.
            let moved = again.iter().zip(&sent_to).any(|(&i, o)| self.owner_of(partitions[i]) != *o);
            if let (Some(conn), false) = (failed.first(), moved) {
                self.reroute(conn);
            }
            let moved = moved || again.iter().zip(&sent_to).any(|(&i, o)| self.owner_of(partitions[i]) != *o);
            if !moved {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            req = self.retag(&req);
            todo = again;
        }
    }

    /// See [`Client::unmount_segment`].
    fn unmount(&self, id: SegmentId) -> Result<(), ErrorCode> {
        let _mounting = self.mounts.lock();
        {
            let mut segments = self.segments.lock();
            let before = segments.len();
            segments.retain(|s| s.desc.id != id);
            if segments.len() == before {
                return Err(ErrorCode::SEGMENT_NOT_FOUND);
            }
        }
        // Off the list first, so that no remount brings it back. A master that misses the
        // unmount drops the segment when it next expires or remounts this client; nothing
        // serves it from now on.
        self.registry.unregister(id);
        self.call(&Request::UnmountSegment { client: self.id, segment: id }).map(|_| ())
    }

    /// Mounts every segment again under a new incarnation (the master forgot this client, or
    /// expired it): ranges handed out before can no longer be read or written, since readers
    /// and writers holding them might otherwise meet the new allocations in the same memory.
    /// Reusable replica lists and peer mappings go too.
    fn remount(&self) -> Result<(), ErrorCode> {
        let _mounting = self.mounts.lock();
        self.leases.lock().clear();
        self.mounted_on.lock().clear();
        let sliced = self.sliced_groups();
        let segments = {
            let mut segs = self.segments.lock();
            for s in segs.iter_mut() {
                match sliced {
                    // Each primary says which of its groups dropped the segments (MountSlices):
                    // only their slices start over.
                    Some(groups) => s.slice(groups),
                    None => {
                        s.memory.clear_slices();
                        s.book = SliceBook::default();
                        s.desc.incarnation = s.memory.bump_incarnation();
                    }
                }
            }
            segs.iter().map(|s| s.desc.clone()).collect()
        };
        self.call(&Request::ReMountSegment { client: self.id, segments }).map(|_| ())
    }

    /// Names segment `id` the stable segment `name` at every primary; done once one of them
    /// stored its descriptor (each stores the same one).
    fn name_stable(&self, id: SegmentId, name: &str, medium: Medium) -> Result<(), ErrorCode> {
        let req = Request::StableSegment { client: self.id, segment: id, name: name.to_owned(), medium };
        let answers = if self.routes.read().partitioned() {
            self.call_each_primary(&req)
        } else {
            vec![(self.conn("").addr().to_string(), self.call_seeds(&req))]
        };
        let mut first_error = None;
        for (owner, answer) in answers {
            match answer {
                Ok(_) => return Ok(()),
                Err(e) => {
                    tracing::warn!(master = %owner, error = %e, segment = name, "a primary did not store the stable segment's descriptor");
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(first_error.unwrap_or(ErrorCode::RPC_FAIL))
    }

    /// The cluster's group count when this client's segments keep an incarnation per group's
    /// slice: a partitioned cluster of at most [`tycho_proto::MAX_SLICES`] groups.
    fn sliced_groups(&self) -> Option<u32> {
        let routes = self.routes.read();
        let groups = routes.table().groups;
        (routes.partitioned() && (2..=tycho_proto::MAX_SLICES).contains(&groups)).then_some(groups)
    }

    /// Mounts this client's segments at `owner` with an incarnation per slice (MountSlices). A
    /// group of `owner`'s that dropped them (it expired this client, or an admin unmounted
    /// one) is answered with new incarnations of its slice, so that only that group's replicas
    /// are lost; the other groups keep theirs, and so do other primaries.
    fn mount_slices_at(&self, owner: &str) -> Result<(), ErrorCode> {
        let _mounting = self.mounts.lock();
        let conn = self.conn(owner);
        // A group refuses a slice's incarnation once at most (a fresh one is always taken);
        // another round covers a group that moved to `owner` meanwhile.
        for _ in 0..3 {
            let segments: Vec<SlicedSegment> = self.segments.lock().iter_mut().map(Segment::sliced).collect();
            let req = Request::MountSlices { client: self.id, segments };
            match call_patiently(&conn, &req, self.patience(&req))? {
                Response::Slices { stale, .. } if stale.is_empty() => {
                    self.mounted_on.lock().insert(owner.to_string());
                    return Ok(());
                }
                Response::Slices { stale, .. } => {
                    tracing::info!(master = %owner, groups = ?stale, "a primary dropped this client's segments in its groups; their slices start over");
                    for s in self.segments.lock().iter_mut() {
                        s.memory.bump_slices(&stale);
                        s.desc.incarnation = s.memory.incarnation();
                        s.book.started_over(&stale);
                    }
                }
                _ => return Err(ErrorCode::INTERNAL_ERROR),
            }
        }
        Err(ErrorCode::RPC_FAIL)
    }

    /// Notes the master instance a heartbeat reported; a new instance (a restarted master)
    /// invalidates every reusable replica list.
    fn saw_master(&self, instance: u64) {
        let before = self.master_instance.swap(instance, Ordering::AcqRel);
        if before != 0 && before != instance {
            self.leases.lock().clear();
            self.engine.forget_mappings();
        }
    }

    fn heartbeat_loop(&self) {
        loop {
            {
                let mut stop = self.heartbeat.stop.lock();
                if *stop {
                    return;
                }
                self.heartbeat.wake.wait_for(&mut stop, self.cfg.heartbeat_interval);
                if *stop {
                    return;
                }
            }
            let pinged = self.call(&Request::Ping { client: self.id });
            // With several groups, who serves them moves (claims, failovers): the route table is
            // read again each beat (after the pings, which must not wait for it), so that every
            // primary hears from this client in time.
            if self.routes.read().table().groups > 1 {
                self.reroute(self.master());
            }
            match pinged {
                Ok(Response::Ping(PingReply { status: ClientStatus::NeedRemount, master_instance })) => {
                    self.saw_master(master_instance);
                    tracing::info!(client = %self.id, "master asks for a remount");
                    self.engine.forget_mappings();
                    if let Err(e) = self.remount() {
                        tracing::warn!(error = %e, "remount failed; will retry");
                    }
                }
                Ok(Response::Ping(PingReply { master_instance, .. })) => self.saw_master(master_instance),
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "heartbeat failed; will retry"),
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.server.lock().take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replica reader `r` picks among `segments` for `key`.
    fn pick(r: u128, key: &str, segments: &[SegmentId]) -> SegmentId {
        let seed = rendezvous_seed(ClientId(r), key);
        *segments.iter().max_by_key(|s| rendezvous_score(seed, **s)).unwrap()
    }

    #[test]
    fn readers_spread_evenly_over_equivalent_replicas_and_a_loss_moves_only_its_own() {
        let segments: Vec<SegmentId> = (0..4u128).map(|i| SegmentId(0x5eed_0000 + i * 7919)).collect();
        let readers: Vec<u128> =
            (0..8000u128).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834)).collect();
        for key in ["hot/system-prompt", "k", "a-much-longer-key-of-a-document-prefix/0042"] {
            let before: Vec<SegmentId> = readers.iter().map(|r| pick(*r, key, &segments)).collect();
            for s in &segments {
                let share = before.iter().filter(|p| *p == s).count() as f64 / readers.len() as f64;
                assert!((0.2..0.3).contains(&share), "{key}: {s} serves {share:.3} of the readers, not about 1/4");
            }
            // The third replica goes: its readers move, nobody else's does.
            let left: Vec<SegmentId> = segments.iter().copied().filter(|s| *s != segments[2]).collect();
            for (r, was) in readers.iter().zip(&before) {
                let now = pick(*r, key, &left);
                if *was != segments[2] {
                    assert_eq!(now, *was, "{key}: a reader of a replica that stayed moved");
                }
            }
        }
        // A reader keeps its replica from call to call; another key ranks them anew.
        let r = readers[17];
        assert_eq!(pick(r, "k", &segments), pick(r, "k", &segments));
        let firsts: std::collections::BTreeSet<SegmentId> =
            (0..64).map(|i| pick(r, &format!("key-{i}"), &segments)).collect();
        assert_eq!(firsts.len(), segments.len(), "one reader's keys use every replica");
    }
}
