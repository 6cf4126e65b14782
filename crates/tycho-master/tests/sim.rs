//! A deterministic simulation of the partitioned plane's control logic: the CVM's role rules
//! ([`cvm::plan`]), the route cache ([`RouteCache`]) and commit-time fencing
//! ([`BatchCommit`]), all sans-IO, driven by a seeded scheduler over a real [`MemStore`] (with
//! a manual clock, so that leases expire when the scheduler says).
//!
//! Masters, clients and the store exchange messages through a simulated network that the
//! scheduler delivers in any order, delays, loses (a request lost, an answer lost after the
//! store applied it, a request applied after its sender gave up on it), and cuts masters off
//! (partitions); masters crash, losing everything, and come back under the same id. After
//! every step it checks that
//!
//! - a transaction that commits a group's log batch comes from the master the group's record
//!   names primary, at the record's epoch (no commit by any other master succeeds);
//! - every master that believes it serves a group under the record's current revision is the
//!   one the record names (one primary per group);
//!
//! - a read is answered only by a master that serves the group, with durable state alone (the
//!   read rule: writes applied but not yet committed are not shown), and never with a write
//!   that was refused;
//!
//! and at the end, after a quiet phase without faults, that every group is served by its
//! recorded primary, every client's route cache names it, a fresh write to each group is
//! acknowledged, and each group's log holds every acknowledged write exactly once, no refused
//! write, no write twice, and exactly what its primary serves — and every write any read
//! returned (no failover took back what a reader saw).
//!
//! Operators request reshards ([`reshard`]) at random: the target joins, catches up, sets the
//! record migrating and switches once the source has frozen writes and marked the request, as
//! `ha` does, through the same role rules. Masters die at any of those steps, failovers race
//! them, and a master may hang as a target (keeping its lease, never switching) until the
//! source's freeze limit abandons the move. Writes refused with KVPT_MIGRATING must never reach
//! a log, and at the end no request is left and every record is stable.
//!
//! `TYCHO_SIM_SCHEDULES` (default 20,000, about 85 s on two cores) sets how many schedules run; a failure prints its
//! seed, and `TYCHO_SIM_SEED=<seed>` replays that one schedule alone (add
//! `TYCHO_SIM_TRACE=1` to print every step).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tycho_master::commit::{BatchCommit, Io, Reply};
use tycho_master::cvm::{self, Action, GroupView};
use tycho_master::oplog::{read_durable, Fence, LogError, LogKeys};
use tycho_master::ownership::{self, ClusterKeys, GroupRecord, GroupState, OwnershipError};
use tycho_master::record::{Record, RecordBatch};
use tycho_master::reshard::{self, ReshardIntent, FREEZE_LIMIT};
use tycho_meta::{
    Clock, KeyValue, LeaseId, ManualClock, MemConfig, MemStore, MetaError, MetaResult, MetaStore, RangeRequest,
    Revision, Txn, TxnOp, TxnResponse,
};
use tycho_proto::cluster::{MasterRegistration, Role};
use tycho_proto::{ClientId, ErrorCode, RouteTable};
use tycho_routing::RouteCache;

/// Lease TTL of a master's registration.
const LEASE_TTL: Duration = Duration::from_secs(3);
/// Rounds of the quiet phase (each delivers everything and ticks every master).
const QUIET_ROUNDS: usize = 80;
/// Most records in one log batch.
const BATCH: usize = 3;
/// Seeds from here on are reshard schedules (see [`run`]).
const RESHARD_SEEDS: u64 = 1 << 40;

/// splitmix64: small, and the same on every platform and toolchain.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Which of a master's sequential activities a store message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Task {
    View,
    Lease,
    Group(u32),
    /// A serving group's reshard work (marking the request frozen, ending it), beside its log.
    Reshard(u32),
}

/// A request to the coordination store.
#[derive(Debug, Clone)]
enum Op {
    /// Registrations (oldest first) and every group record.
    View,
    /// Grant a lease and register under it.
    Register,
    KeepAlive(LeaseId),
    Create {
        rank: u32,
        caretake: bool,
    },
    /// `change_group`: the record read at `read.1`, with this primary.
    Change {
        read: (GroupRecord, Revision),
        primary: String,
        caretaken: bool,
    },
    /// `change_standbys`: add the sender.
    Join {
        read: (GroupRecord, Revision),
    },
    /// A log batch's transaction, made under `epoch`.
    Txn {
        txn: Txn,
        epoch: u64,
    },
    Get(Vec<u8>),
    /// Where group `rank`'s log ends.
    Tail {
        rank: u32,
    },
    /// Every log batch of group `rank` from sequence number `from` on.
    ReadLog {
        rank: u32,
        from: u64,
    },
    /// The target sets the record migrating to it.
    SetMigrating {
        read: (GroupRecord, Revision),
    },
    /// The source marks the request frozen at log position `at`.
    MarkFrozen {
        read: (ReshardIntent, Revision),
        at: u64,
    },
    /// The primary ends a reshard (as `ha::end_reshard`): deletes the request, then lifts the
    /// freeze or drops the target from the standbys.
    EndReshard {
        intent: Option<(ReshardIntent, Revision)>,
        read: (GroupRecord, Revision),
        /// Sent because the freeze reached its limit.
        limit: bool,
    },
}

type Intents = Vec<Option<(ReshardIntent, Revision)>>;
type View = (Vec<String>, Vec<Option<(GroupRecord, Revision)>>, Intents);

/// The store's answer (`Lost`: the request or its answer was lost; the sender knows nothing).
#[derive(Debug)]
enum Ans {
    View(View),
    Registered(LeaseId),
    /// The master's id is still registered (its former life's lease lives on): wait.
    StillRegistered,
    KeptAlive(MetaResult<Duration>),
    Owned(Result<(GroupRecord, Revision), OwnershipError>),
    Txn(MetaResult<TxnResponse>),
    Got(Option<KeyValue>),
    Log(Vec<KeyValue>),
    /// Where a group's log ends ([`read_durable`]).
    Tail(u64),
    /// A reshard step's outcome (`ended`: it was an [`Op::EndReshard`]).
    Reshard {
        ended: bool,
        result: Result<(), OwnershipError>,
    },
    Lost,
}

#[derive(Debug, Clone)]
enum ClientReq {
    Put {
        op: u64,
        rank: u32,
        epoch: u64,
    },
    /// A lookup of everything group `rank` holds.
    Read {
        rank: u32,
    },
    Routes,
}

#[derive(Debug)]
enum ClientResp {
    Acked(u64),
    Refused(u64, ErrorCode),
    Unknown(u64),
    Routes(RouteTable),
    /// The writes a read of group `rank` found.
    Read(u32, Vec<u64>),
}

#[derive(Debug)]
enum Msg {
    ToStore { m: usize, tok: u64, task: Task, op: Op },
    FromStore { m: usize, tok: u64, task: Task, ans: Ans },
    ToMaster { c: usize, m: usize, req: ClientReq },
    ToClient { c: usize, resp: ClientResp },
}

/// The I/O a serving group's commit machine waits on.
#[derive(Debug, Clone)]
enum Pending {
    Send,
    Read(Vec<u8>),
}

struct Serving {
    commit: BatchCommit,
    epoch: u64,
    queue: Vec<(u64, usize)>,
    batch: Option<Vec<(u64, usize)>>,
    pending: Option<Pending>,
    /// Given up: answers what is in flight, then leaves the group.
    dropping: bool,
    /// Since when new writes are frozen (the record is migrating).
    frozen_since: Option<std::time::Instant>,
}

enum GRole {
    None,
    Standby,
    /// Named primary by the record read at `rev`: reading the log to its end.
    CatchingUp {
        record: GroupRecord,
        rev: Revision,
    },
    Serving(Box<Serving>),
}

struct GroupSide {
    /// The token of the store request in flight (0: none).
    busy: u64,
    /// The token of the reshard request in flight of a serving group (0: none).
    rbusy: u64,
    /// Its last promotion was a reshard's switch.
    switching: bool,
    role: GRole,
    /// Whether `ops` is the group's state up to `applied` (it followed or served the group).
    holds: bool,
    applied: u64,
    ops: Vec<u64>,
}

impl GroupSide {
    fn new() -> GroupSide {
        GroupSide { busy: 0, rbusy: 0, switching: false, role: GRole::None, holds: false, applied: 0, ops: Vec::new() }
    }

    fn forget(&mut self) {
        self.holds = false;
        self.applied = 0;
        self.ops.clear();
    }

    /// Follows the group's log as its standby, from what it holds (from the start if nothing).
    fn stand_by(&mut self) {
        if !matches!(self.role, GRole::Standby) {
            self.role = GRole::Standby;
            if !self.holds {
                self.forget();
                self.holds = true;
            }
        }
    }
}

struct MasterSim {
    id: String,
    up: bool,
    inc: u64,
    lease: Option<LeaseId>,
    /// Tokens of the view and lease requests in flight (0: none). An answer whose token is not
    /// the one awaited (the sender gave up on it and asked again) is dropped.
    view_busy: u64,
    lease_busy: u64,
    /// Steps left cut off from everyone.
    cut: usize,
    /// Steps left paused (a long GC or scheduling pause): its messages wait, none is lost.
    paused: usize,
    /// When the lease request in flight was sent, and the local deadline of the lease: past
    /// it, without a renewal, the master stops serving by itself (as `ha`'s deadline fence).
    renew_sent: Option<std::time::Instant>,
    deadline: Option<std::time::Instant>,
    groups: Vec<GroupSide>,
    routes: RouteCache,
    /// As a reshard's target, it never switches (it keeps its lease and follows on).
    hangs: bool,
}

struct ClientSim {
    cache: RouteCache,
}

struct World {
    rng: Rng,
    trace: bool,
    clock: Arc<ManualClock>,
    /// The clock's start: request deadlines count from it (as Unix ms count from 1970).
    start: std::time::Instant,
    store: MemStore,
    keys: ClusterKeys,
    g: u32,
    masters: Vec<MasterSim>,
    clients: Vec<ClientSim>,
    net: Vec<Msg>,
    next_op: u64,
    next_tok: u64,
    /// How likely each kind of event is in this schedule (see [`World::chaos_step`]): each
    /// schedule draws its own mix, from calm to stormy.
    weights: [u32; 11],
    /// Steps of the faulty phase.
    steps: usize,
    acked: BTreeSet<u64>,
    refused: BTreeSet<u64>,
    /// Every write some read returned: each must be in its group's log at the end.
    read: BTreeSet<u64>,
    /// What happened, for the summary: writes whose outcome their client never learned,
    /// ownership changes won, and log writers fenced.
    figures: Figures,
    step: usize,
    /// In a quiet phase: no fault at all.
    calm: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    acked: usize,
    /// Reads answered.
    reads: usize,
    refused: usize,
    unknown: usize,
    promotions: usize,
    fenced: usize,
    /// Reshards requested, switched (the target promoted by its move), abandoned (ended at
    /// a primary that is not the target), voided by a failover (abandoned because the group
    /// changed primary since the request), lifted at the freeze's limit, marked frozen; writes
    /// refused with KVPT_MIGRATING.
    reshards: usize,
    switched: usize,
    abandoned: usize,
    voided: usize,
    at_limit: usize,
    frozen: usize,
    migrating: usize,
    /// Kills of a reshard's source (0..4) and target (4..8) at each step: requested, target
    /// listed as standby, record migrating, request marked frozen.
    kills: [usize; 8],
}

impl std::ops::AddAssign for Figures {
    fn add_assign(&mut self, o: Figures) {
        self.acked += o.acked;
        self.reads += o.reads;
        self.refused += o.refused;
        self.unknown += o.unknown;
        self.promotions += o.promotions;
        self.fenced += o.fenced;
        self.reshards += o.reshards;
        self.switched += o.switched;
        self.abandoned += o.abandoned;
        self.voided += o.voided;
        self.at_limit += o.at_limit;
        self.frozen += o.frozen;
        self.migrating += o.migrating;
        for (k, o) in self.kills.iter_mut().zip(o.kills) {
            *k += o;
        }
    }
}

/// What a master knows of the routes before it reads the records: the group count only.
fn no_routes(g: u32) -> RouteCache {
    let mut c = RouteCache::new();
    c.learn(&RouteTable {
        groups: g,
        epochs: vec![0; g as usize],
        owners: vec![String::new(); g as usize],
        lease_ttl_ms: 0,
    });
    c
}

/// Runs `f` on the store: MemStore answers at once, so the future is ready on its first poll.
fn now<T>(f: impl std::future::Future<Output = T>) -> T {
    f.now_or_never().expect("MemStore answers without waiting")
}

fn unavailable() -> MetaError {
    MetaError::Unavailable("the simulated network lost the message".into())
}

impl World {
    fn new(seed: u64, trace: bool) -> World {
        let mut rng = Rng(seed);
        let g = 1 + rng.below(3) as u32;
        let m = 2 + rng.below(3);
        let clock = ManualClock::new();
        let store = MemStore::with_clock(clock.clone(), MemConfig::default());
        let masters = (0..m)
            .map(|i| MasterSim {
                id: format!("m{i}"),
                up: true,
                inc: 0,
                lease: None,
                view_busy: 0,
                lease_busy: 0,
                cut: 0,
                paused: 0,
                renew_sent: None,
                deadline: None,
                groups: (0..g).map(|_| GroupSide::new()).collect(),
                routes: no_routes(g),
                hangs: false,
            })
            .collect();
        // deliver, tick, put, routes, clock, crash, cut, pause, lose, reshard, hang.
        let base = [45, 15, 15, 4, 2, 2, 2, 6, 7, 2, 1];
        let weights = base.map(|w| w * (1 + rng.below(4) as u32) / 2);
        let steps = 150 + rng.below(300);
        let clients = (0..2).map(|_| ClientSim { cache: RouteCache::new() }).collect();
        let start = clock.now();
        World {
            rng,
            trace,
            clock,
            start,
            store,
            keys: ClusterKeys::new("sim"),
            g,
            masters,
            clients,
            net: Vec::new(),
            next_op: 1,
            next_tok: 1,
            weights,
            steps,
            acked: BTreeSet::new(),
            refused: BTreeSet::new(),
            read: BTreeSet::new(),
            figures: Figures::default(),
            step: 0,
            calm: false,
        }
    }

    fn log(&self, what: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("[{:4}] {}", self.step, what());
        }
    }

    fn log_keys(&self, rank: u32) -> LogKeys {
        LogKeys::new(self.keys.cluster(), rank)
    }

    /// The simulated wall clock, in ms.
    fn now_ms(&self) -> u64 {
        (self.clock.now() - self.start).as_millis() as u64
    }

    fn index_of(&self, id: &str) -> Option<usize> {
        self.masters.iter().position(|m| m.id == id)
    }

    /// Sends `op` for `task` of master `m`, which awaits its answer from now on.
    fn send(&mut self, m: usize, task: Task, op: Op) {
        let tok = self.next_tok;
        self.next_tok += 1;
        let master = &mut self.masters[m];
        match task {
            Task::View => master.view_busy = tok,
            Task::Lease => master.lease_busy = tok,
            Task::Group(rank) => master.groups[rank as usize].busy = tok,
            Task::Reshard(rank) => master.groups[rank as usize].rbusy = tok,
        }
        self.net.push(Msg::ToStore { m, tok, task, op });
    }

    // ---- the scheduler ----

    /// One step of the faulty phase.
    fn chaos_step(&mut self) {
        let total: u32 = self.weights.iter().sum();
        let mut roll = self.rng.below(total as usize) as u32;
        let mut event = 0;
        while roll >= self.weights[event] {
            roll -= self.weights[event];
            event += 1;
        }
        match event {
            0 => self.deliver_any(),
            1 => {
                let m = self.rng.below(self.masters.len());
                self.tick(m);
            }
            2 if self.rng.below(4) == 0 => self.client_read(),
            2 => self.client_put(),
            3 => {
                let c = self.rng.below(self.clients.len());
                let m = self.rng.below(self.masters.len());
                self.net.push(Msg::ToMaster { c, m, req: ClientReq::Routes });
            }
            4 => {
                self.log(|| "clock +1s".into());
                self.clock.advance(Duration::from_secs(1));
            }
            5 => self.crash_or_restart(),
            6 => {
                let m = self.rng.below(self.masters.len());
                let steps = 5 + self.rng.below(40);
                self.log(|| format!("m{m} cut off for {steps} steps"));
                self.masters[m].cut = steps;
            }
            7 => {
                let m = self.rng.below(self.masters.len());
                let steps = 20 + self.rng.below(200);
                self.log(|| format!("m{m} paused for {steps} steps"));
                self.masters[m].paused = steps;
            }
            8 => self.lose_one(),
            9 => drop(self.request_reshard()),
            _ => {
                let m = self.rng.below(self.masters.len());
                let hangs = !self.masters[m].hangs;
                self.log(|| format!("m{m} {} as a reshard's target", if hangs { "hangs" } else { "no longer hangs" }));
                self.masters[m].hangs = hangs;
            }
        }
        for m in &mut self.masters {
            m.cut = m.cut.saturating_sub(1);
            m.paused = m.paused.saturating_sub(1);
        }
        self.deadlines();
    }

    /// Delivers one message, chosen at random among those not held by a paused master.
    fn deliver_any(&mut self) {
        let ready: Vec<usize> = (0..self.net.len())
            .filter(|&i| {
                let m = match &self.net[i] {
                    Msg::ToStore { m, .. } | Msg::FromStore { m, .. } | Msg::ToMaster { m, .. } => *m,
                    Msg::ToClient { .. } => return true,
                };
                self.masters[m].paused == 0
            })
            .collect();
        if ready.is_empty() {
            return;
        }
        let i = ready[self.rng.below(ready.len())];
        let msg = self.net.swap_remove(i);
        self.deliver(msg);
    }

    /// Loses a message: a request to the store is lost before it runs, or applied and its
    /// answer lost, or left in the network to be applied late while its sender hears nothing
    /// back; any other message is simply lost (a client's request goes unanswered).
    fn lose_one(&mut self) {
        if self.net.is_empty() {
            return;
        }
        let i = self.rng.below(self.net.len());
        let how = self.rng.below(3);
        match &self.net[i] {
            Msg::ToStore { m, tok, task, .. } => {
                let (m, tok, task) = (*m, *tok, *task);
                let lost = Msg::FromStore { m, tok, task, ans: Ans::Lost };
                match how {
                    0 => {
                        self.log(|| format!("lost a request of m{m} ({task:?})"));
                        self.net.swap_remove(i);
                    }
                    1 => {
                        self.log(|| format!("applied a request of m{m} ({task:?}), lost its answer"));
                        let msg = self.net.swap_remove(i);
                        if let Msg::ToStore { m, task, op, .. } = msg {
                            let _ = self.apply(m, task, op);
                        }
                    }
                    _ => self.log(|| format!("m{m} gives up on a request ({task:?}) still in the network")),
                }
                self.net.push(lost);
            }
            Msg::FromStore { m, tok, task, .. } => {
                let (m, tok, task) = (*m, *tok, *task);
                self.log(|| format!("lost an answer to m{m} ({task:?})"));
                self.net[i] = Msg::FromStore { m, tok, task, ans: Ans::Lost };
            }
            Msg::ToMaster { c, req: ClientReq::Put { op, .. }, .. } => {
                let (c, op) = (*c, *op);
                self.net[i] = Msg::ToClient { c, resp: ClientResp::Unknown(op) };
            }
            _ => {
                self.net.swap_remove(i);
            }
        }
    }

    fn crash_or_restart(&mut self) {
        let m = self.rng.below(self.masters.len());
        if self.masters[m].up {
            self.crash(m);
        } else {
            self.masters[m].up = true;
            self.log(|| format!("m{m} restarted"));
        }
    }

    /// Master `m` dies, losing everything; kills in the middle of a reshard are counted by its
    /// step and by whether `m` is its source or its target.
    fn crash(&mut self, m: usize) {
        let id = self.masters[m].id.clone();
        let intents = now(reshard::read_intents(&self.store, &self.keys, self.g)).expect("readable intents");
        for (i, _) in intents.into_iter().flatten() {
            let Some((rec, _)) = now(ownership::read_group(&self.store, &self.keys, i.rank)).expect("readable") else {
                continue;
            };
            let step = if i.frozen_at.is_some() {
                3
            } else if rec.state == GroupState::Migrating {
                2
            } else if rec.standbys.contains(&i.target) {
                1
            } else {
                0
            };
            if id == i.source {
                self.figures.kills[step] += 1;
            }
            if id == i.target {
                self.figures.kills[4 + step] += 1;
            }
        }
        let master = &mut self.masters[m];
        {
            master.up = false;
            master.inc += 1;
            master.lease = None;
            master.renew_sent = None;
            master.deadline = None;
            master.view_busy = 0;
            master.lease_busy = 0;
            master.routes = no_routes(self.g);
            for g in &mut master.groups {
                *g = GroupSide::new();
            }
            self.log(|| format!("m{m} crashed"));
        }
    }

    /// An operator asks some master to move a group to some master (live or not), due within
    /// 2 to 40 s. The request's checks and its write run as one store call here.
    fn request_reshard(&mut self) -> bool {
        let rank = self.rng.below(self.g as usize) as u32;
        let target = self.masters[self.rng.below(self.masters.len())].id.clone();
        let deadline = 2_000 + 1_000 * self.rng.below(39) as u64;
        let now_ms = self.now_ms();
        let r = now(reshard::request(&self.store, &self.keys, self.g, rank, &target, now_ms, deadline));
        self.log(|| format!("operator: move group {rank} to {target} within {deadline} ms: {r:?}"));
        self.figures.reshards += usize::from(r.is_ok());
        r.is_ok()
    }

    fn client_put(&mut self) {
        let c = self.rng.below(self.clients.len());
        let rank = self.rng.below(self.g as usize) as u32;
        let op = self.next_op;
        self.next_op += 1;
        let cache = &self.clients[c].cache;
        let owner = cache.owner(rank).to_string();
        let epoch = cache.table().epochs.get(rank as usize).copied().filter(|&e| e > 0).unwrap_or(1);
        let m = match self.index_of(&owner) {
            Some(m) => m,
            None => self.rng.below(self.masters.len()),
        };
        self.log(|| format!("client {c} puts op {op} (group {rank}, epoch {epoch}) at m{m}"));
        self.net.push(Msg::ToMaster { c, m, req: ClientReq::Put { op, rank, epoch } });
    }

    /// A client reads a group at the master its route cache names.
    fn client_read(&mut self) {
        let c = self.rng.below(self.clients.len());
        let rank = self.rng.below(self.g as usize) as u32;
        let m = self.index_of(self.clients[c].cache.owner(rank)).unwrap_or_else(|| self.rng.below(self.masters.len()));
        self.log(|| format!("client {c} reads group {rank} at m{m}"));
        self.net.push(Msg::ToMaster { c, m, req: ClientReq::Read { rank } });
    }

    // ---- delivery ----

    fn deliver(&mut self, msg: Msg) {
        match msg {
            Msg::ToStore { m, tok, task, op } => {
                if self.masters[m].cut > 0 {
                    self.log(|| format!("m{m} is cut off: its request ({task:?}) is lost"));
                    self.net.push(Msg::FromStore { m, tok, task, ans: Ans::Lost });
                    return;
                }
                let ans = self.apply(m, task, op);
                self.net.push(Msg::FromStore { m, tok, task, ans });
            }
            Msg::FromStore { m, tok, task, ans } => {
                let master = &mut self.masters[m];
                let awaited = match task {
                    Task::View => &mut master.view_busy,
                    Task::Lease => &mut master.lease_busy,
                    Task::Group(rank) => &mut master.groups[rank as usize].busy,
                    Task::Reshard(rank) => &mut master.groups[rank as usize].rbusy,
                };
                // A crashed master awaits nothing; one that gave up on a request awaits its
                // next one.
                if !master.up || *awaited != tok {
                    return;
                }
                *awaited = 0;
                let ans = if master.cut > 0 { Ans::Lost } else { ans };
                self.answer(m, task, ans);
            }
            Msg::ToMaster { c, m, req } => self.client_request(c, m, req),
            Msg::ToClient { c, resp } => self.client_answer(c, resp),
        }
    }

    /// Applies a request to the store, checking that a log commit comes from the primary.
    fn apply(&mut self, m: usize, task: Task, op: Op) -> Ans {
        let store: &dyn MetaStore = &self.store;
        let keys = &self.keys;
        let id = self.masters[m].id.clone();
        match op {
            Op::View => {
                let live = match now(ownership::masters(store, keys)) {
                    Ok(l) => l.into_iter().map(|(r, _)| r.id).collect(),
                    Err(_) => return Ans::Lost,
                };
                let records =
                    (0..self.g).map(|r| now(ownership::read_group(store, keys, r)).expect("a readable record"));
                let intents = now(reshard::read_intents(store, keys, self.g)).expect("readable intents");
                Ans::View((live, records.collect(), intents))
            }
            Op::Register => {
                // As `ha` registers: a new key under a new lease, once the id's earlier
                // registration has ended (so a restarted master rejoins as the youngest).
                let grant = now(store.lease_grant(LEASE_TTL)).expect("lease");
                let reg =
                    MasterRegistration { id: id.clone(), address: id.clone(), role: Role::Idle, registered_at_ms: 0 };
                match now(store.create_if_absent(&keys.master(&id), &reg.encode(), Some(grant.id))) {
                    Ok(_) => Ans::Registered(grant.id),
                    Err(MetaError::CompareFailed { .. }) => {
                        now(store.lease_revoke(grant.id)).expect("revoke");
                        Ans::StillRegistered
                    }
                    Err(e) => panic!("register: {e}"),
                }
            }
            Op::KeepAlive(lease) => Ans::KeptAlive(now(store.lease_keep_alive_once(lease))),
            Op::Create { rank, caretake } => Ans::Owned(now(ownership::create_group(store, keys, rank, &id, caretake))),
            Op::Change { read, primary, caretaken } => {
                Ans::Owned(now(ownership::change_group(store, keys, &read, |g| {
                    g.standbys.retain(|s| *s != primary);
                    g.primary = primary.clone();
                    g.caretaken = caretaken;
                    g.state = GroupState::Stable;
                    g.migrating_to = None;
                })))
            }
            Op::Join { read } => {
                Ans::Owned(now(ownership::change_standbys(store, keys, &read, |s| s.push(id.clone()))))
            }
            Op::Txn { txn, epoch } => {
                let Task::Group(rank) = task else { panic!("a log transaction outside a group task") };
                let record = now(ownership::read_group(store, keys, rank)).expect("a readable record");
                let writes_batch = txn
                    .success
                    .iter()
                    .any(|o| matches!(o, TxnOp::Put { key, .. } if key.starts_with(&self.log_keys(rank).batches())));
                let r = now(store.txn(txn));
                if let (Ok(resp), true) = (&r, writes_batch) {
                    if resp.succeeded {
                        let (rec, _) = record.expect("a log commit without a group record");
                        // (A migrating record's source still commits what it admitted.)
                        assert!(
                            rec.primary == id && rec.epoch == epoch,
                            "a log batch of group {rank} committed by {id} at epoch {epoch} while the record names {} at epoch {}",
                            rec.primary,
                            rec.epoch
                        );
                        self.log(|| format!("{id} committed a batch of group {rank} at epoch {epoch}"));
                    }
                }
                Ans::Txn(r)
            }
            Op::Get(key) => match now(store.get(&key)) {
                Ok(r) => Ans::Got(r.kv),
                Err(_) => Ans::Lost,
            },
            Op::Tail { rank } => match now(read_durable(store, &self.log_keys(rank))) {
                Ok(durable) => Ans::Tail(durable),
                Err(e) => panic!("group {rank}'s log has no readable end: {e}"),
            },
            Op::ReadLog { rank, from } => {
                let lk = self.log_keys(rank);
                let mut req = RangeRequest::prefix(lk.batches(), 0);
                req.start = Some(lk.batch(from));
                match now(store.range(req)) {
                    Ok(page) => Ans::Log(page.kvs),
                    Err(_) => Ans::Lost,
                }
            }
            Op::SetMigrating { read } => Ans::Owned(now(ownership::set_migrating(store, keys, &read, Some(&id)))),
            Op::MarkFrozen { read, at } => {
                let result = now(reshard::mark_frozen(store, keys, &read, at)).map(drop);
                self.figures.frozen += usize::from(result.is_ok());
                Ans::Reshard { ended: false, result }
            }
            Op::EndReshard { intent, read, limit } => {
                // As `ha::end_reshard`, two store calls: a master may die between them.
                let done = intent.as_ref().is_some_and(|(i, _)| i.target == id);
                if let Some((i, rev)) = &intent {
                    let key = keys.reshard_intent(read.0.rank);
                    let there = now(store.get(&key)).expect("get").kv.is_some_and(|kv| kv.mod_revision == *rev);
                    now(reshard::clear(store, keys, read.0.rank, *rev)).expect("clear");
                    if there && !done {
                        self.figures.abandoned += 1;
                        self.figures.voided += usize::from(i.source != read.0.primary || i.epoch != read.0.epoch);
                    }
                    if !self.calm && self.rng.below(4) == 0 {
                        self.log(|| {
                            format!("{id} dies between clearing group {}'s request and the record", read.0.rank)
                        });
                        self.crash(m);
                        return Ans::Lost;
                    }
                }
                let target = intent.map(|(i, _)| i.target).filter(|t| !done && read.0.standbys.contains(t));
                let result = if read.0.state == GroupState::Migrating {
                    let r = now(ownership::set_migrating(store, keys, &read, None)).map(drop);
                    self.figures.at_limit += usize::from(limit && r.is_ok());
                    r
                } else if let Some(target) = target {
                    now(ownership::change_standbys(store, keys, &read, |s| s.retain(|x| *x != target))).map(drop)
                } else {
                    Ok(())
                };
                Ans::Reshard { ended: true, result }
            }
        }
    }

    // ---- masters ----

    /// A master's periodic work: register, keep its lease, read the records and decide.
    fn tick(&mut self, m: usize) {
        let master = &mut self.masters[m];
        if !master.up || master.paused > 0 {
            return;
        }
        if master.lease_busy == 0 {
            master.renew_sent = Some(self.clock.now());
            let op = match master.lease {
                None => Op::Register,
                Some(l) => Op::KeepAlive(l),
            };
            self.send(m, Task::Lease, op);
        }
        let master = &mut self.masters[m];
        if master.lease.is_some() && master.view_busy == 0 {
            self.send(m, Task::View, Op::View);
        }
        // Primaries catching up read the log on (standbys read it when the view says Follow).
        for rank in 0..self.g {
            let side = &self.masters[m].groups[rank as usize];
            if side.busy == 0 && matches!(side.role, GRole::CatchingUp { .. }) {
                let from = side.applied + 1;
                self.send(m, Task::Group(rank), Op::ReadLog { rank, from });
            }
        }
    }

    fn answer(&mut self, m: usize, task: Task, ans: Ans) {
        match task {
            Task::Lease => {
                let master = &mut self.masters[m];
                let renewed = master.renew_sent.map(|at| at + LEASE_TTL / 2);
                match ans {
                    Ans::Registered(lease) => {
                        master.lease = Some(lease);
                        master.deadline = renewed;
                    }
                    Ans::KeptAlive(Ok(_)) if master.lease.is_some() => master.deadline = renewed,
                    Ans::KeptAlive(Err(MetaError::LeaseNotFound { .. })) => self.lease_lost(m),
                    _ => {}
                }
            }
            Task::View => {
                if let Ans::View(view) = ans {
                    self.decide(m, view);
                }
            }
            Task::Group(rank) => self.group_answer(m, rank, ans),
            Task::Reshard(rank) => {
                // A reshard ended (or lifted): writes thaw.
                if let Ans::Reshard { ended: true, result: Ok(()) } = ans {
                    if let GRole::Serving(s) = &mut self.masters[m].groups[rank as usize].role {
                        s.frozen_since = None;
                    }
                }
            }
        }
    }

    /// Every running master whose lease's local deadline passed without a renewal stops
    /// serving (a paused one cannot: that is the case commit-time fencing is for).
    fn deadlines(&mut self) {
        let now = self.clock.now();
        for m in 0..self.masters.len() {
            let master = &self.masters[m];
            if master.up && master.paused == 0 && master.deadline.is_some_and(|d| now > d) {
                self.log(|| format!("m{m}'s lease deadline passed"));
                self.lease_lost(m);
            }
        }
    }

    /// The lease expired, or its deadline passed: the master gives up every group and
    /// registers again (under a new lease, once the old one ended).
    fn lease_lost(&mut self, m: usize) {
        self.log(|| format!("m{m} lost its lease"));
        self.masters[m].lease = None;
        self.masters[m].deadline = None;
        for rank in 0..self.g {
            self.drop_group(m, rank);
        }
    }

    /// Gives group `rank` up: what waits is refused; a batch in flight is answered first.
    fn drop_group(&mut self, m: usize, rank: u32) {
        let side = &mut self.masters[m].groups[rank as usize];
        match &mut side.role {
            GRole::Serving(s) => {
                let queued = std::mem::take(&mut s.queue);
                if s.batch.is_some() {
                    s.dropping = true;
                } else {
                    side.role = GRole::None;
                    side.forget();
                }
                for (op, c) in queued {
                    self.net.push(Msg::ToClient { c, resp: ClientResp::Refused(op, ErrorCode::KVPT_NOT_OWNED) });
                }
            }
            GRole::CatchingUp { .. } => {
                side.role = GRole::None;
                side.forget();
            }
            GRole::Standby | GRole::None => side.role = GRole::None,
        }
    }

    /// The role loop: plans from a view of the records and starts each group's action.
    fn decide(&mut self, m: usize, (live, records, intents): View) {
        if self.masters[m].lease.is_none() {
            return;
        }
        let me = self.masters[m].id.clone();
        let table = RouteTable {
            groups: self.g,
            epochs: records.iter().map(|r| r.as_ref().map_or(0, |(g, _)| g.epoch)).collect(),
            owners: records.iter().map(|r| r.as_ref().map_or(String::new(), |(g, _)| g.primary.clone())).collect(),
            lease_ttl_ms: 0,
        };
        self.masters[m].routes.learn(&table);
        let now_ms = self.now_ms();
        let views: Vec<GroupView> = records
            .iter()
            .zip(&intents)
            .map(|(r, i)| GroupView::of(r.as_ref().map(|(g, _)| g), i.as_ref().map(|(i, _)| i), now_ms))
            .collect();
        let holds: Vec<bool> = self.masters[m].groups.iter().map(|s| s.holds).collect();
        let plan = cvm::plan(&me, &live, &views, |r| holds[r as usize]);
        self.log(|| format!("{me} plans {plan:?} (live {live:?})"));
        for rank in 0..self.g {
            let action = plan.iter().find(|(r, _)| *r == rank).map(|(_, a)| a.clone());
            let side = &self.masters[m].groups[rank as usize];
            let serving = matches!(&side.role, GRole::Serving(s) if !s.dropping);
            if serving && !matches!(action, Some(Action::Serve | Action::EndReshard)) {
                self.log(|| format!("{me} gives group {rank} up ({action:?})"));
                self.drop_group(m, rank);
            }
            if serving {
                self.source_step(
                    m,
                    rank,
                    action.as_ref(),
                    records[rank as usize].clone(),
                    intents[rank as usize].clone(),
                );
                continue;
            }
            let side = &self.masters[m].groups[rank as usize];
            if side.busy != 0 || matches!(side.role, GRole::Serving(_) | GRole::CatchingUp { .. }) {
                continue;
            }
            let hangs = self.masters[m].hangs;
            let frozen = intents[rank as usize].as_ref().is_some_and(|(i, _)| i.frozen_at.is_some());
            self.masters[m].groups[rank as usize].switching = false;
            let read = records[rank as usize].clone();
            let op = match (action, read) {
                (Some(Action::Create { caretake }), _) => Op::Create { rank, caretake },
                (Some(Action::Serve), Some(read)) => {
                    let caretaken = read.0.caretaken;
                    Op::Change { read, primary: me.clone(), caretaken }
                }
                (Some(Action::HandTo(heir)), Some(read)) => Op::Change { read, primary: heir, caretaken: false },
                (Some(Action::TakeOver { caretake }), Some(read)) => {
                    Op::Change { read, primary: me.clone(), caretaken: caretake }
                }
                (Some(Action::Claim), Some(read)) => Op::Change { read, primary: me.clone(), caretaken: false },
                (Some(Action::JoinAsStandby), Some(read)) => Op::Join { read },
                // Named primary, not serving yet (a promotion whose answer was lost): the
                // request is ended first, then the next view says Serve.
                (Some(Action::EndReshard), Some(read)) => {
                    Op::EndReshard { intent: intents[rank as usize].clone(), read, limit: false }
                }
                // The reshard's target (as `ha::migrate`): caught up, it sets the record
                // migrating; once the source marked the request frozen, it promotes; until
                // then (or while it hangs) it follows.
                (Some(Action::Migrate), Some(read)) => {
                    let side = &mut self.masters[m].groups[rank as usize];
                    let followed = matches!(side.role, GRole::Standby) && side.holds;
                    let mine = read.0.migrating_to.as_deref() == Some(me.as_str());
                    if read.0.state == GroupState::Stable && followed {
                        Op::SetMigrating { read }
                    } else if read.0.state == GroupState::Migrating && mine && frozen && !hangs {
                        side.switching = true;
                        Op::Change { read, primary: me.clone(), caretaken: false }
                    } else {
                        side.stand_by();
                        Op::ReadLog { rank, from: side.applied + 1 }
                    }
                }
                (Some(Action::Follow), Some(_)) => {
                    let side = &mut self.masters[m].groups[rank as usize];
                    side.stand_by();
                    Op::ReadLog { rank, from: side.applied + 1 }
                }
                _ => continue,
            };
            if matches!(&op, Op::Change { primary, .. } if *primary == me) {
                // Promoting: the state is what it replayed, or (holding nothing) the log from
                // its start, as a restore from snapshot and log.
                let side = &mut self.masters[m].groups[rank as usize];
                if !side.holds {
                    side.forget();
                    side.holds = true;
                }
            }
            self.log(|| format!("{me} group {rank}: {op:?}"));
            self.send(m, Task::Group(rank), op);
        }
    }

    /// A serving group's reshard part (as `ha::source_freezes` and `ha::end_reshard`): while
    /// the record is migrating, admit no new write; once no batch is in flight, mark the
    /// request frozen at the log's end; past the freeze's limit, or when the plan says so, end
    /// the reshard.
    fn source_step(
        &mut self,
        m: usize,
        rank: u32,
        action: Option<&Action>,
        record: Option<(GroupRecord, Revision)>,
        intent: Option<(ReshardIntent, Revision)>,
    ) {
        let now = self.clock.now();
        let side = &mut self.masters[m].groups[rank as usize];
        let GRole::Serving(s) = &mut side.role else { return };
        let Some(read) = record else { return };
        let migrating = read.0.state == GroupState::Migrating;
        let op = match action {
            Some(Action::Serve) if !migrating => {
                s.frozen_since = None;
                return;
            }
            Some(Action::Serve) => {
                let since = *s.frozen_since.get_or_insert(now);
                if now - since >= FREEZE_LIMIT {
                    Op::EndReshard { intent, read, limit: true }
                } else {
                    match intent {
                        Some(i) if i.0.frozen_at.is_none() && s.batch.is_none() => {
                            Op::MarkFrozen { read: i, at: s.commit.durable() }
                        }
                        _ => return,
                    }
                }
            }
            Some(Action::EndReshard) => Op::EndReshard { intent, read, limit: false },
            _ => return,
        };
        if side.rbusy != 0 {
            return;
        }
        self.log(|| format!("m{m} group {rank}: {op:?}"));
        self.send(m, Task::Reshard(rank), op);
    }

    fn group_answer(&mut self, m: usize, rank: u32, ans: Ans) {
        let me = self.masters[m].id.clone();
        let side = &mut self.masters[m].groups[rank as usize];
        if let GRole::Serving(_) = side.role {
            return self.commit_answer(m, rank, ans);
        }
        match ans {
            Ans::Owned(Ok((record, rev))) if record.primary == me => {
                // Named primary: replay the log to its end (from scratch without the state).
                if !side.holds {
                    side.forget();
                }
                side.holds = true;
                let epoch = record.epoch;
                side.role = GRole::CatchingUp { record, rev };
                self.figures.promotions += 1;
                self.figures.switched += usize::from(std::mem::take(&mut side.switching));
                self.log(|| format!("{me} is primary of group {rank} at epoch {epoch}"));
            }
            Ans::Log(kvs) => {
                if !matches!(side.role, GRole::Standby | GRole::CatchingUp { .. }) {
                    return;
                }
                for kv in kvs {
                    let batch = RecordBatch::decode(&kv.value).expect("a readable log batch");
                    if batch.last_seq() <= side.applied {
                        continue;
                    }
                    assert_eq!(batch.first_seq, side.applied + 1, "group {rank}'s log has a gap");
                    for rec in &batch.records {
                        let Record::WriteEnd { write_id, .. } = rec else { panic!("unexpected record {rec:?}") };
                        side.ops.push(*write_id);
                    }
                    side.applied = batch.last_seq();
                }
                if matches!(side.role, GRole::CatchingUp { .. }) {
                    self.send(m, Task::Group(rank), Op::Tail { rank });
                }
            }
            Ans::Tail(durable) => {
                let GRole::CatchingUp { record, rev } = &side.role else { return };
                if durable > side.applied {
                    return; // more to read: the next tick reads on
                }
                assert_eq!(durable, side.applied, "replayed past the log's end");
                let fence =
                    Fence { key: self.keys.group(rank), mod_revision: *rev, owner: Some((me.clone(), record.epoch)) };
                let epoch = record.epoch;
                let commit = BatchCommit::new(LogKeys::new(self.keys.cluster(), rank), fence, rank, durable);
                side.role = GRole::Serving(Box::new(Serving {
                    commit,
                    epoch,
                    queue: Vec::new(),
                    batch: None,
                    pending: None,
                    dropping: false,
                    frozen_since: None,
                }));
                self.masters[m].routes.note(rank, epoch, &me);
                self.log(|| format!("{me} serves group {rank} at epoch {epoch}"));
            }
            _ => {}
        }
    }

    /// Starts the next batch of a serving group, if one waits and none is in flight.
    fn start_batch(&mut self, m: usize, rank: u32) {
        let side = &mut self.masters[m].groups[rank as usize];
        let GRole::Serving(s) = &mut side.role else { return };
        if s.batch.is_some() || s.queue.is_empty() || s.dropping {
            return;
        }
        let n = s.queue.len().min(BATCH);
        let taken: Vec<(u64, usize)> = s.queue.drain(..n).collect();
        let records = taken
            .iter()
            .map(|&(op, c)| Record::WriteEnd {
                key: op.to_le_bytes().to_vec(),
                writer: ClientId(c as u128 + 1),
                write_id: op,
                at_ms: 0,
                dropped: Vec::new(),
            })
            .collect();
        let batch = RecordBatch { group: rank, epoch: s.epoch, first_seq: s.commit.durable() + 1, records };
        let io = s.commit.begin(batch.first_seq, batch.last_seq(), batch.encode());
        s.batch = Some(taken);
        self.commit_io(m, rank, io);
    }

    /// Carries out what the commit machine asks.
    fn commit_io(&mut self, m: usize, rank: u32, io: Io) {
        let side = &mut self.masters[m].groups[rank as usize];
        let GRole::Serving(s) = &mut side.role else { return };
        let (pending, op) = match io {
            Io::Send(txn) => (Pending::Send, Op::Txn { txn, epoch: s.epoch }),
            Io::Read { key, .. } => (Pending::Read(key.clone()), Op::Get(key)),
            Io::Done(result) => {
                let batch = s.batch.take().unwrap_or_default();
                s.pending = None;
                let mut answers = Vec::new();
                for &(op, c) in &batch {
                    answers.push(Msg::ToClient {
                        c,
                        resp: match &result {
                            Ok(()) => ClientResp::Acked(op),
                            // Fenced or closed: the batch is not in the log and never will be.
                            Err(LogError::Fenced(_) | LogError::Closed) => {
                                ClientResp::Refused(op, ErrorCode::KVPT_NOT_OWNED)
                            }
                            Err(_) => ClientResp::Unknown(op),
                        },
                    });
                }
                let go_on = result.is_ok() && !s.dropping;
                if result.is_ok() {
                    side.applied = s.commit.durable();
                    side.ops.extend(batch.iter().map(|(op, _)| *op));
                }
                if !go_on {
                    // The log ended or the group was given up: what waits is refused.
                    for (op, c) in std::mem::take(&mut s.queue) {
                        answers.push(Msg::ToClient { c, resp: ClientResp::Refused(op, ErrorCode::KVPT_NOT_OWNED) });
                    }
                    side.role = GRole::None;
                    side.forget();
                }
                if let Err(e) = &result {
                    self.figures.fenced += usize::from(matches!(e, LogError::Fenced(_)));
                    self.log(|| format!("m{m} group {rank}: log ended: {e}"));
                }
                self.net.extend(answers);
                if go_on {
                    self.start_batch(m, rank);
                }
                return;
            }
        };
        s.pending = Some(pending);
        self.send(m, Task::Group(rank), op);
    }

    /// A store answer to a serving group's commit machine.
    fn commit_answer(&mut self, m: usize, rank: u32, ans: Ans) {
        let side = &mut self.masters[m].groups[rank as usize];
        let GRole::Serving(s) = &mut side.role else { return };
        let Some(pending) = s.pending.take() else { return };
        let reply = match (pending, ans) {
            (Pending::Send, Ans::Txn(r)) => Reply::Sent(r),
            (Pending::Send, Ans::Lost) => Reply::Sent(Err(unavailable())),
            (Pending::Read(_), Ans::Got(kv)) => Reply::Read(Ok(kv)),
            // A read the store did not answer is sent again.
            (Pending::Read(key), Ans::Lost) => return self.commit_io(m, rank, Io::Read { key, pause: true }),
            (p, a) => panic!("commit answer {a:?} does not match {p:?}"),
        };
        let io = s.commit.on(reply);
        self.commit_io(m, rank, io);
    }

    fn client_request(&mut self, c: usize, m: usize, req: ClientReq) {
        let master = &mut self.masters[m];
        if !master.up || master.cut > 0 {
            if let ClientReq::Put { op, .. } = req {
                self.net.push(Msg::ToClient { c, resp: ClientResp::Unknown(op) });
            }
            return;
        }
        match req {
            ClientReq::Routes => {
                let t = master.routes.table().clone();
                self.net.push(Msg::ToClient { c, resp: ClientResp::Routes(t) });
            }
            // The read rule: only a master serving the group (its log not ended, its lease
            // within its local deadline: `deadlines` stands it down past that) answers, and
            // only with what is durable. Writes applied but in flight (queued, or in the batch
            // being committed) are not shown: the real master's answer waits for them.
            ClientReq::Read { rank } => {
                let side = &master.groups[rank as usize];
                if let GRole::Serving(s) = &side.role {
                    if !s.dropping {
                        assert_eq!(side.applied, s.commit.durable(), "a primary serves what its log made durable");
                        let found = side.ops.clone();
                        self.net.push(Msg::ToClient { c, resp: ClientResp::Read(rank, found) });
                    }
                }
            }
            ClientReq::Put { op, rank, epoch } => {
                let refuse = match &mut master.groups[rank as usize].role {
                    GRole::Serving(s) if !s.dropping && s.epoch == epoch && s.frozen_since.is_some() => {
                        Some(ErrorCode::KVPT_MIGRATING)
                    }
                    GRole::Serving(s) if !s.dropping && s.epoch == epoch => {
                        s.queue.push((op, c));
                        None
                    }
                    GRole::Serving(s) if !s.dropping && epoch < s.epoch => Some(ErrorCode::STALE_EPOCH),
                    _ => Some(ErrorCode::KVPT_NOT_OWNED),
                };
                match refuse {
                    None => self.start_batch(m, rank),
                    Some(code) => self.net.push(Msg::ToClient { c, resp: ClientResp::Refused(op, code) }),
                }
            }
        }
    }

    fn client_answer(&mut self, c: usize, resp: ClientResp) {
        match resp {
            ClientResp::Routes(t) => {
                self.clients[c].cache.learn(&t);
            }
            ClientResp::Acked(op) => {
                assert!(!self.refused.contains(&op), "op {op} acknowledged after it was refused");
                assert!(self.acked.insert(op), "op {op} acknowledged twice");
            }
            ClientResp::Refused(op, code) => {
                assert!(
                    matches!(code, ErrorCode::KVPT_NOT_OWNED | ErrorCode::STALE_EPOCH | ErrorCode::KVPT_MIGRATING),
                    "op {op} refused with {code:?}, not a routing error"
                );
                self.figures.migrating += usize::from(code == ErrorCode::KVPT_MIGRATING);
                assert!(!self.acked.contains(&op), "op {op} refused after it was acknowledged");
                self.refused.insert(op);
                // Route again: ask some master.
                let m = self.rng.below(self.masters.len());
                self.net.push(Msg::ToMaster { c, m, req: ClientReq::Routes });
            }
            ClientResp::Unknown(op) => {
                self.log(|| format!("client {c} never learns what became of op {op}"));
                self.figures.unknown += 1;
            }
            ClientResp::Read(rank, found) => {
                for op in &found {
                    assert!(!self.refused.contains(op), "a read of group {rank} returned op {op}, which was refused");
                }
                self.figures.reads += 1;
                self.read.extend(found);
            }
        }
    }

    // ---- invariants ----

    /// After every step: a master that believes it serves a group under the record's current
    /// revision is the record's primary.
    fn check_step(&self) {
        for rank in 0..self.g {
            let Some((rec, rev)) = now(ownership::read_group(&self.store, &self.keys, rank)).expect("readable") else {
                continue;
            };
            for master in self.masters.iter().filter(|m| m.up) {
                if let GRole::Serving(s) = &master.groups[rank as usize].role {
                    if s.commit.fence_revision() == rev {
                        assert_eq!(
                            master.id, rec.primary,
                            "{} serves group {rank} under the record's revision {rev}, which names {}",
                            master.id, rec.primary
                        );
                    }
                }
            }
        }
    }

    /// The log of group `rank`: its write ids in order, checked contiguous and sealed.
    fn log_of(&self, rank: u32) -> Vec<u64> {
        let lk = self.log_keys(rank);
        let page = now(self.store.range(RangeRequest::prefix(lk.batches(), 0))).expect("range");
        let mut next = 1;
        let mut ops = Vec::new();
        for kv in page.kvs {
            let batch = RecordBatch::decode(&kv.value).expect("a readable batch");
            assert_eq!(batch.first_seq, next, "group {rank}'s log is not contiguous");
            next = batch.last_seq() + 1;
            for r in batch.records {
                let Record::WriteEnd { write_id, .. } = r else { panic!("unexpected record") };
                ops.push(write_id);
            }
        }
        let durable = now(read_durable(&self.store, &lk)).expect("the log's end");
        assert_eq!(durable, next - 1, "group {rank}'s log does not end at its last record");
        ops
    }

    /// What each master is, for failure messages.
    fn dump(&self) -> String {
        let mut out = String::new();
        for m in &self.masters {
            out += &format!("\n  {} up={} lease={:?} cut={} hangs={}:", m.id, m.up, m.lease, m.cut, m.hangs);
            for (rank, side) in m.groups.iter().enumerate() {
                let role = match &side.role {
                    GRole::None => "none".to_string(),
                    GRole::Standby => "standby".to_string(),
                    GRole::CatchingUp { record, rev } => format!("catching up (epoch {} at {rev})", record.epoch),
                    GRole::Serving(s) => format!(
                        "serving (epoch {}, fence {}, dropping {}, batch {}, frozen {})",
                        s.epoch,
                        s.commit.fence_revision(),
                        s.dropping,
                        s.batch.is_some(),
                        s.frozen_since.is_some()
                    ),
                };
                out += &format!(
                    " [g{rank}: {role}, holds {}, applied {}, busy {}/{}]",
                    side.holds, side.applied, side.busy, side.rbusy
                );
            }
        }
        out
    }

    // ---- the quiet phase ----

    /// Delivers everything in the network, oldest first, until it is empty (bounded).
    fn drain(&mut self) {
        for _ in 0..10_000 {
            if self.net.is_empty() {
                return;
            }
            let msg = self.net.remove(0);
            self.deliver(msg);
            self.check_step();
        }
        panic!("the network does not drain");
    }

    /// Heals every fault, then runs `rounds` rounds without any: each ticks every master and
    /// delivers everything; the clock moves a second every other round.
    fn quiet(&mut self, rounds: usize) {
        for m in &mut self.masters {
            m.cut = 0;
            m.paused = 0;
            m.up = true;
        }
        self.calm = true;
        for round in 0..rounds {
            self.step += 1;
            for m in 0..self.masters.len() {
                self.tick(m);
            }
            self.drain();
            if round % 2 == 1 {
                self.clock.advance(Duration::from_secs(1));
            }
            self.deadlines();
        }
        self.calm = false;
    }

    /// After the quiet phase: every group served by its primary, clients routed to it, a fresh
    /// write acknowledged, and the logs complete, without duplicates or refused writes.
    fn check_end(&mut self) {
        let mut primaries = Vec::new();
        for rank in 0..self.g {
            let (rec, rev) = now(ownership::read_group(&self.store, &self.keys, rank))
                .expect("readable")
                .unwrap_or_else(|| panic!("group {rank} was never created"));
            let m = self.index_of(&rec.primary).expect("a known primary");
            // (Its fence may lag a change of the standbys: the next commit renews it.)
            let serving = matches!(&self.masters[m].groups[rank as usize].role,
                GRole::Serving(s) if !s.dropping && s.epoch == rec.epoch && s.commit.fence_revision() <= rev);
            assert!(
                serving,
                "group {rank}'s primary {} does not serve it after the quiet phase (record {rec:?} at {rev}); {}",
                rec.primary,
                self.dump()
            );
            assert!(
                rec.state == GroupState::Stable && rec.migrating_to.is_none(),
                "group {rank} is left migrating after the quiet phase: {rec:?}; {}",
                self.dump()
            );
            let frozen =
                matches!(&self.masters[m].groups[rank as usize].role, GRole::Serving(s) if s.frozen_since.is_some());
            assert!(!frozen, "group {rank}'s primary {} still freezes its writes", rec.primary);
            primaries.push((rec, m));
        }
        let left: Vec<ReshardIntent> = now(reshard::read_intents(&self.store, &self.keys, self.g))
            .expect("readable intents")
            .into_iter()
            .flatten()
            .map(|(i, _)| i)
            .collect();
        assert!(left.is_empty(), "reshard requests left after the quiet phase: {left:?}; {}", self.dump());
        // Every client learns the routes from every master and converges on the owners.
        for c in 0..self.clients.len() {
            for m in 0..self.masters.len() {
                self.net.push(Msg::ToMaster { c, m, req: ClientReq::Routes });
            }
        }
        self.drain();
        for (c, client) in self.clients.iter().enumerate() {
            for (rank, (rec, _)) in primaries.iter().enumerate() {
                assert_eq!(
                    (client.cache.owner(rank as u32), client.cache.table().epochs[rank]),
                    (rec.primary.as_str(), rec.epoch),
                    "client {c} does not route group {rank} to its primary"
                );
            }
        }
        // A fresh write to each group through each client's routes is acknowledged.
        let mut fresh = Vec::new();
        for c in 0..self.clients.len() {
            for rank in 0..self.g {
                let op = self.next_op;
                self.next_op += 1;
                let owner = self.clients[c].cache.owner(rank).to_string();
                let epoch = self.clients[c].cache.table().epochs[rank as usize];
                let m = self.index_of(&owner).expect("routed");
                self.net.push(Msg::ToMaster { c, m, req: ClientReq::Put { op, rank, epoch } });
                fresh.push(op);
            }
        }
        self.drain();
        for op in fresh {
            assert!(self.acked.contains(&op), "a write after the quiet phase was not acknowledged (op {op})");
        }
        // The logs: every acknowledged write once, no refused one, no duplicate; and the state
        // each primary serves is its log.
        let mut seen = BTreeSet::new();
        for rank in 0..self.g {
            let ops = self.log_of(rank);
            for op in &ops {
                assert!(seen.insert(*op), "op {op} is in the logs twice");
                assert!(!self.refused.contains(op), "op {op} was refused, yet it is in group {rank}'s log");
            }
            let m = primaries[rank as usize].1;
            assert_eq!(self.masters[m].groups[rank as usize].ops, ops, "group {rank}'s primary serves another state");
        }
        let lost: Vec<&u64> = self.acked.iter().filter(|op| !seen.contains(op)).collect();
        assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
        let unread: Vec<&u64> = self.read.iter().filter(|op| !seen.contains(op)).collect();
        assert!(unread.is_empty(), "writes a reader saw are not in the logs: {unread:?}");
    }
}

/// One schedule; panics (with what broke) on a violated invariant.
fn run(seed: u64, trace: bool) -> Figures {
    let mut w = World::new(seed, trace);
    if seed >= RESHARD_SEEDS {
        // A reshard's schedule: a settled cluster, a request that holds, then milder faults
        // (a few kills, cuts, pauses and lost messages) that meet the move at any of its steps.
        w.weights = [50, 25, 12, 3, 1, 1, 1, 1, 2, 0, 1];
        w.quiet(10);
        for _ in 0..20 {
            if w.request_reshard() {
                break;
            }
        }
    } else if w.rng.below(4) != 0 {
        // Most schedules start from a settled cluster; the others race its bootstrap too.
        w.quiet(10);
        // Half of those start a reshard at once, so that the faults to come meet its steps.
        if w.rng.below(2) == 0 {
            w.request_reshard();
        }
    }
    for _ in 0..w.steps {
        w.step += 1;
        w.chaos_step();
        w.check_step();
    }
    w.quiet(QUIET_ROUNDS);
    w.check_end();
    Figures { acked: w.acked.len(), refused: w.refused.len(), ..w.figures }
}

fn seeds(range: std::ops::Range<u64>) {
    if let Ok(seed) = std::env::var("TYCHO_SIM_SEED") {
        if range.start == 0 {
            let seed: u64 = seed.parse().expect("TYCHO_SIM_SEED is a number");
            let trace = std::env::var_os("TYCHO_SIM_TRACE").is_some();
            eprintln!("seed {seed}: {:?}", run(seed, trace));
        }
        return;
    }
    let mut all = Figures::default();
    for seed in range.clone() {
        let r = std::panic::catch_unwind(|| run(seed, false));
        match r {
            Ok(f) => all += f,
            Err(e) => {
                let why = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!(
                    "schedule {seed} failed: {why}\nreplay it: TYCHO_SIM_SEED={seed} TYCHO_SIM_TRACE=1 cargo test -p tycho-master --test sim -- --nocapture"
                );
            }
        }
    }
    eprintln!("schedules {range:?}: every invariant held; {all:?}");
    if range.end - range.start >= 1000 && range.start < RESHARD_SEEDS {
        assert!(all.acked > 0 && all.promotions > 0 && all.fenced > 0, "the schedules exercised too little: {all:?}");
    }
    if range.end - range.start >= 1000 && range.start >= RESHARD_SEEDS {
        assert!(
            all.acked > 0
                && all.switched > 0
                && all.abandoned > 0
                && all.voided > 0
                && all.at_limit > 0
                && all.frozen > 0
                && all.migrating > 0
                && all.kills.iter().all(|&k| k > 0),
            "the reshard schedules exercised too little: {all:?}"
        );
    }
}

/// How many schedules to run in all: two fifths in each of the first two tests, a fifth (of
/// reshards) in the third; the tests run in parallel.
fn total() -> u64 {
    std::env::var("TYCHO_SIM_SCHEDULES").ok().and_then(|s| s.parse().ok()).unwrap_or(20_000)
}

#[test]
fn schedules_first_half() {
    seeds(0..total() * 2 / 5);
}

#[test]
fn schedules_second_half() {
    seeds(total() * 2 / 5..total() * 4 / 5);
}

#[test]
fn reshard_schedules() {
    seeds(RESHARD_SEEDS..RESHARD_SEEDS + total() / 5);
}

// ---- per-group node liveness (issue 47) --------------------------------------------------------

/// Nodes judged alive per group: each group's primary expires a node on its own, and drops the
/// node's replicas in its own groups only. The node's side ([`SliceBook`]: which slices some
/// master mounted under their current incarnation) and the master's verdict on a MountSlices
/// ([`stale_slices`]) are the production code; around them a model of the rest: a node keeps
/// an incarnation per slice (one counter, as the segment header does), pings every primary
/// each tick unless cut off from it, and on NeedRemount mounts its segment at every primary
/// with MountSlices, starting over the slices a primary answers stale; a master forgets a node
/// silent for a TTL and unmounts it in its groups; groups move between masters with their
/// state (as a replay of their log carries it), and a crash loses a master's table of clients.
///
/// After every step: every group that holds a node holds it under the node's current
/// incarnation of that slice (so every replica it lists passes the node's check); no group
/// mounts again an incarnation it dropped (a reader of the dropped ranges could pass its check);
/// and a replica is lost only when its own group's primary expired its node. At the end, after
/// a quiet phase, every node is mounted in every group and every replica not lost is readable.
mod liveness {
    use std::collections::{BTreeMap, BTreeSet};

    use tycho_proto::{stale_slices, SliceBook};

    use super::Rng;

    /// Ticks without a ping after which a master forgets a node (its client TTL).
    const TTL: u64 = 3;

    struct Group {
        owner: usize,
        /// The nodes whose segment the group holds, each under one incarnation of its slice.
        mounts: BTreeMap<usize, u32>,
        /// Every (node, incarnation) the group held and dropped.
        dropped: BTreeSet<(usize, u32)>,
        /// Replicas it lists: (replica, node, incarnation).
        replicas: Vec<(u64, usize, u32)>,
    }

    struct Node {
        /// The segment header's counter and its slices' incarnations.
        counter: u32,
        incarnations: Vec<u32>,
        book: SliceBook,
        /// Per master: cut off from it until this tick.
        cut_until: Vec<u64>,
        /// The masters that took its segment since its last remount (the client's
        /// `mounted_on`): the others get it at the next tick.
        mounted_on: BTreeSet<usize>,
    }

    #[derive(Debug, Default, Clone, Copy)]
    pub struct Figures {
        pub expiries: usize,
        pub remounts: usize,
        pub started_over: usize,
        pub lost: usize,
        pub kept_through_expiry: usize,
        pub moves: usize,
    }

    struct World {
        rng: Rng,
        now: u64,
        groups: Vec<Group>,
        /// Per master: the nodes it knows and when each last pinged.
        heard: Vec<BTreeMap<usize, u64>>,
        nodes: Vec<Node>,
        next_replica: u64,
        lost: BTreeSet<u64>,
        figures: Figures,
        /// Mount requests and answers may be lost (not in the quiet phase).
        lossy: bool,
    }

    impl World {
        fn owned(&self, m: usize) -> Vec<u32> {
            (0..self.groups.len() as u32).filter(|&r| self.groups[r as usize].owner == m).collect()
        }

        /// Node `n`'s MountSlices at master `m`, with the node's reaction to a stale answer.
        fn mount_slices(&mut self, n: usize, m: usize) {
            let mut lost_answer = false;
            for _ in 0..3 {
                let node = &mut self.nodes[n];
                let incarnations = &node.incarnations;
                let offered = node.book.offer_once(|r| incarnations[r as usize]);
                if self.lossy && self.rng.below(10) == 0 {
                    // The request, or its answer, is lost: the master may have mounted or not.
                    // The slices offered are no longer fresh either way.
                    if self.rng.below(2) == 0 {
                        return;
                    }
                    lost_answer = true;
                }
                let serving = self.owned(m);
                let groups = &self.groups;
                let stale =
                    stale_slices(serving.iter().copied(), |r| groups[r as usize].mounts.get(&n).copied(), &offered);
                if !stale.is_empty() && lost_answer {
                    return;
                }
                if !stale.is_empty() {
                    let node = &mut self.nodes[n];
                    node.counter += 1;
                    for &r in &stale {
                        node.incarnations[r as usize] = node.counter;
                    }
                    node.book.started_over(&stale);
                    self.figures.started_over += 1;
                    continue;
                }
                for &r in &serving {
                    let inc = offered[r as usize].incarnation;
                    let g = &mut self.groups[r as usize];
                    assert!(
                        !g.dropped.contains(&(n, inc)),
                        "group {r} mounts node {n}'s incarnation {inc} again after dropping it"
                    );
                    match g.mounts.get(&n).copied() {
                        Some(held) if held == inc => {}
                        Some(held) => {
                            assert!(held < inc, "group {r} holds node {n} under {held}, newer than {inc}");
                            // A newer incarnation replaces an older one: its replicas go. The
                            // node starts a slice over only where its group does not hold it.
                            assert!(
                                !g.replicas.iter().any(|&(_, rn, _)| rn == n),
                                "group {r}'s replicas on node {n} dropped by a remount at master {m}"
                            );
                            g.dropped.insert((n, held));
                            g.mounts.insert(n, inc);
                        }
                        None => {
                            g.mounts.insert(n, inc);
                        }
                    }
                }
                self.heard[m].insert(n, self.now);
                self.figures.remounts += 1;
                if !lost_answer {
                    self.nodes[n].mounted_on.insert(m);
                }
                return;
            }
            // Three stale answers in a row: the next tick tries again (the client's next beat).
        }

        /// Master `m` forgets the nodes silent for a TTL and unmounts them in its groups.
        fn expire(&mut self, m: usize) {
            let now = self.now;
            let silent: Vec<usize> =
                self.heard[m].iter().filter(|&(_, &at)| at + TTL <= now).map(|(&n, _)| n).collect();
            for n in silent {
                self.heard[m].remove(&n);
                self.figures.expiries += 1;
                let mine = self.owned(m);
                for r in 0..self.groups.len() as u32 {
                    let g = &mut self.groups[r as usize];
                    if !mine.contains(&r) {
                        self.figures.kept_through_expiry += g.replicas.iter().filter(|&&(_, rn, _)| rn == n).count();
                        continue;
                    }
                    if let Some(inc) = g.mounts.remove(&n) {
                        g.dropped.insert((n, inc));
                        let (gone, kept): (Vec<_>, Vec<_>) = g.replicas.drain(..).partition(|&(_, rn, _)| rn == n);
                        g.replicas = kept;
                        self.figures.lost += gone.len();
                        self.lost.extend(gone.into_iter().map(|(id, _, _)| id));
                    }
                }
            }
        }

        /// A tick: every node first mounts at the masters that have not taken its segment since
        /// its last remount, then pings every master it is not cut off from (some pings are
        /// lost); a master that does not know it, or one of whose groups lacks its segment,
        /// answers NeedRemount, and the node mounts again at every primary it reaches; then
        /// every master expires the silent.
        fn tick(&mut self, loss: usize) {
            self.now += 1;
            for n in 0..self.nodes.len() {
                for m in 0..self.heard.len() {
                    if !self.nodes[n].mounted_on.contains(&m) && self.nodes[n].cut_until[m] <= self.now {
                        self.mount_slices(n, m);
                    }
                }
                let mut remount = false;
                for m in 0..self.heard.len() {
                    if self.nodes[n].cut_until[m] > self.now || self.rng.below(100) < loss {
                        continue;
                    }
                    let lacks = self.owned(m).iter().any(|&r| !self.groups[r as usize].mounts.contains_key(&n));
                    match self.heard[m].get_mut(&n) {
                        Some(at) => {
                            *at = self.now;
                            remount |= lacks;
                        }
                        None => remount = true,
                    }
                }
                if remount {
                    self.nodes[n].mounted_on.clear();
                    for m in 0..self.heard.len() {
                        if self.nodes[n].cut_until[m] <= self.now {
                            self.mount_slices(n, m);
                        }
                    }
                }
            }
            for m in 0..self.heard.len() {
                self.expire(m);
            }
        }

        /// A write to group `r` on some node it holds, stamped with the node's incarnation.
        fn put(&mut self, r: usize) {
            let held: Vec<(usize, u32)> = self.groups[r].mounts.iter().map(|(&n, &i)| (n, i)).collect();
            if held.is_empty() {
                return;
            }
            let (n, inc) = held[self.rng.below(held.len())];
            assert_eq!(self.nodes[n].incarnations[r], inc, "group {r} places on node {n} under a dead incarnation");
            self.next_replica += 1;
            self.groups[r].replicas.push((self.next_replica, n, inc));
        }

        /// Group `r` moves to master `to` with its state; `to` counts the nodes it knows as just
        /// heard (as `take_over` does), and the others get NeedRemount at their next ping.
        fn hand_over(&mut self, r: usize, to: usize) {
            self.groups[r].owner = to;
            let now = self.now;
            self.heard[to].values_mut().for_each(|at| *at = now);
            self.figures.moves += 1;
        }

        fn check(&self) {
            for (r, g) in self.groups.iter().enumerate() {
                for (&n, &inc) in &g.mounts {
                    assert_eq!(
                        self.nodes[n].incarnations[r], inc,
                        "group {r} holds node {n} under {inc}, which no longer verifies"
                    );
                }
                for &(id, n, inc) in &g.replicas {
                    assert_eq!(
                        g.mounts.get(&n),
                        Some(&inc),
                        "replica {id} of group {r} lists a segment it does not hold"
                    );
                }
            }
        }
    }

    pub fn run(seed: u64) -> Figures {
        let mut rng = Rng(seed ^ 0x5eed_11fe);
        let g = 2 + rng.below(3);
        let masters = 2 + rng.below(2);
        let nodes = 1 + rng.below(3);
        let loss = rng.below(20);
        let mut w = World {
            groups: (0..g)
                .map(|r| Group {
                    owner: r % masters,
                    mounts: BTreeMap::new(),
                    dropped: BTreeSet::new(),
                    replicas: Vec::new(),
                })
                .collect(),
            heard: vec![BTreeMap::new(); masters],
            nodes: (0..nodes)
                .map(|_| Node {
                    counter: 1,
                    incarnations: vec![1; g],
                    book: SliceBook::new(g as u32),
                    cut_until: vec![0; masters],
                    mounted_on: BTreeSet::new(),
                })
                .collect(),
            rng,
            now: 0,
            next_replica: 0,
            lost: BTreeSet::new(),
            figures: Figures::default(),
            lossy: true,
        };
        // Each node mounts at every primary first.
        for n in 0..nodes {
            for m in 0..masters {
                w.mount_slices(n, m);
            }
        }
        w.check();
        for _ in 0..200 {
            match w.rng.below(20) {
                0..=7 => w.tick(loss),
                8..=13 => {
                    let r = w.rng.below(g);
                    w.put(r);
                }
                14..=16 => {
                    // A node cut off from one master for a while (past the TTL, or not).
                    let (n, m) = (w.rng.below(nodes), w.rng.below(masters));
                    w.nodes[n].cut_until[m] = w.now + 1 + w.rng.below(2 * TTL as usize) as u64;
                }
                17 | 18 => {
                    let (r, to) = (w.rng.below(g), w.rng.below(masters));
                    w.hand_over(r, to);
                }
                _ => {
                    // A master crashes and comes back: it knows no node; its groups move to
                    // the others with their state, or stay (it restores them from its log).
                    let m = w.rng.below(masters);
                    w.heard[m].clear();
                    for r in 0..g {
                        if w.groups[r].owner == m && w.rng.below(2) == 0 {
                            let to = w.rng.below(masters);
                            w.hand_over(r, to);
                        }
                    }
                }
            }
            w.check();
        }
        // Quiet: no cut, no lost ping; every node ends up mounted in every group.
        for node in &mut w.nodes {
            node.cut_until.iter_mut().for_each(|c| *c = 0);
        }
        w.lossy = false;
        for _ in 0..3 {
            w.tick(0);
            w.check();
        }
        for (r, group) in w.groups.iter().enumerate() {
            for n in 0..nodes {
                assert_eq!(
                    group.mounts.get(&n),
                    Some(&w.nodes[n].incarnations[r]),
                    "node {n} is not mounted in group {r}"
                );
            }
            for &(id, _, _) in &group.replicas {
                assert!(!w.lost.contains(&id));
            }
        }
        w.figures
    }
}

#[test]
fn per_group_node_liveness_schedules() {
    let n = (total() / 4).max(1);
    let mut all = liveness::Figures::default();
    for seed in 0..n {
        let f = std::panic::catch_unwind(|| liveness::run(seed)).unwrap_or_else(|e| {
            let why = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            panic!("liveness schedule {seed} failed: {}", why.unwrap_or_default())
        });
        all.expiries += f.expiries;
        all.remounts += f.remounts;
        all.started_over += f.started_over;
        all.lost += f.lost;
        all.kept_through_expiry += f.kept_through_expiry;
        all.moves += f.moves;
    }
    eprintln!("{n} liveness schedules: every invariant held; {all:?}");
    if n >= 1000 {
        assert!(
            all.expiries > 0 && all.started_over > 0 && all.lost > 0 && all.kept_through_expiry > 0 && all.moves > 0,
            "the liveness schedules exercised too little: {all:?}"
        );
    }
}
