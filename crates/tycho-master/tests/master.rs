//! Tests of the master service through its public API only. Time moves only through
//! [`ManualClock`]; background work runs only when a test calls `tick()` or `evict()`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tycho_master::policy::EvictionPolicy;
use tycho_master::{
    Clock, EvictQueue, EvictReason, ManualClock, Master, MasterConfig, WriteMode, DEFAULT_CLIENT_TTL_MS,
    DEFAULT_KV_LEASE_TTL_MS, DEFAULT_PUT_START_DISCARD_MS, DEFAULT_PUT_START_RELEASE_MS, DEFAULT_SOFT_PIN_TTL_MS,
    HELD_PAST_EXPIRY_MS, MAX_SOFT_PIN_TTL_MS,
};
use tycho_proto::*;
use tycho_routing::route_for;

// ---- helpers -------------------------------------------------------------------------------

const T: &str = "tenant-a";
const A: ClientId = ClientId(0xA);
const B: ClientId = ClientId(0xB);
const C: ClientId = ClientId(0xC);
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;
const LEASE: u64 = DEFAULT_KV_LEASE_TTL_MS;

struct Env {
    m: Master,
    clock: Arc<ManualClock>,
}

impl Env {
    fn new() -> Env {
        Env::with(MasterConfig::default())
    }

    fn with(cfg: MasterConfig) -> Env {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let m = Master::new(cfg, clock.clone());
        Env { m, clock }
    }

    fn advance(&self, ms: u64) {
        self.clock.advance(ms);
    }

    /// Pings `alive` (so they are not expired) and runs one housekeeping round.
    fn tick_alive(&self, alive: &[ClientId]) {
        for c in alive {
            assert_eq!(self.m.ping(*c).status, ClientStatus::Ok, "client {c} should be known");
        }
        self.m.tick();
    }
}

fn seg_desc(id: u128, size: u64) -> SegmentDesc {
    SegmentDesc {
        id: SegmentId(id),
        name: format!("seg-{id}"),
        base: 0,
        size,
        endpoint: format!("10.0.0.{id}:17000"),
        host: format!("host-{id}"),
        incarnation: 1,
    }
}

/// Mounts segment `id` of `size` bytes for `client` and returns its descriptor.
fn mount(m: &Master, client: ClientId, id: u128, size: u64) -> SegmentDesc {
    let d = seg_desc(id, size);
    m.mount_segment(client, d.clone()).expect("mount");
    d
}

fn kref_in(tenant: &str, key: &str) -> KeyRef {
    KeyRef { key: key.to_string(), route: route_for(tenant, key, 1) }
}

fn kref(key: &str) -> KeyRef {
    kref_in(T, key)
}

/// The write id these tests use for `client`'s write of `key` (one at a time per pair).
fn wid(client: ClientId, key: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in client.0.to_le_bytes().iter().chain(key.as_bytes()) {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h | 1
}

fn ws(client: ClientId, key: &str, size: u64, config: ReplicateConfig) -> WriteStart {
    WriteStart { client, tenant: T.into(), key: kref(key), size, config, write_id: wid(client, key) }
}

fn wf(client: ClientId, key: &str) -> WriteFinish {
    WriteFinish { client, tenant: T.into(), key: kref(key), write_id: wid(client, key) }
}

/// Fills in the write ids of a batch start (see [`wid`]).
fn bws(mut b: BatchWriteStart) -> BatchWriteStart {
    b.write_ids = b.items.iter().map(|(k, _)| wid(b.client, &k.key)).collect();
    b
}

/// Fills in the write ids of a batch end or revoke.
fn bwf(mut b: BatchWriteFinish) -> BatchWriteFinish {
    b.write_ids = b.keys.iter().map(|k| wid(b.client, &k.key)).collect();
    b
}

fn q(key: &str) -> KeyQuery {
    KeyQuery { tenant: T.into(), key: kref(key) }
}

fn start(m: &Master, client: ClientId, key: &str, size: u64) -> WireResult<Vec<ReplicaDesc>> {
    m.write_start(WriteMode::Put, &ws(client, key, size, ReplicateConfig::default()))
}

fn start_cfg(m: &Master, client: ClientId, key: &str, size: u64, cfg: ReplicateConfig) -> WireResult<Vec<ReplicaDesc>> {
    m.write_start(WriteMode::Put, &ws(client, key, size, cfg))
}

fn finish(m: &Master, client: ClientId, key: &str, end: bool) -> WireResult<()> {
    m.write_finish(&wf(client, key), end).map(drop)
}

/// Per-key results without their payloads (the ranges a commit replaced).
fn units<T>(v: Vec<WireResult<T>>) -> Vec<WireResult<()>> {
    v.into_iter().map(|r| r.map(drop)).collect()
}

/// PutStart + PutEnd; returns the replicas placed.
fn put_cfg(m: &Master, client: ClientId, key: &str, size: u64, cfg: ReplicateConfig) -> Vec<ReplicaDesc> {
    let d = start_cfg(m, client, key, size, cfg).unwrap_or_else(|e| panic!("PutStart {key}: {e:?}"));
    finish(m, client, key, true).unwrap_or_else(|e| panic!("PutEnd {key}: {e:?}"));
    d
}

fn put(m: &Master, client: ClientId, key: &str, size: u64) -> Vec<ReplicaDesc> {
    put_cfg(m, client, key, size, ReplicateConfig::default())
}

fn get(m: &Master, key: &str) -> WireResult<ReplicaList> {
    m.get_replica_list(&q(key))
}

fn exists(m: &Master, key: &str) -> WireResult<bool> {
    m.exist_key(&q(key))
}

fn remove(m: &Master, key: &str, force: bool) -> WireResult<()> {
    m.remove(&RemoveKey { tenant: T.into(), key: kref(key), force })
}

/// Bytes reserved over all mounted segments, as the admin listing reports them.
fn used(m: &Master) -> u64 {
    m.list_segments().iter().map(|s| s.used).sum()
}

fn used_of(m: &Master, id: u128) -> Option<u64> {
    m.list_segments().iter().find(|s| s.desc.id == SegmentId(id)).map(|s| s.used)
}

fn objects(m: &Master) -> u64 {
    m.stats().objects
}

/// Keys of tenant `T` present (complete or not); does not touch leases.
fn keys(m: &Master) -> BTreeSet<String> {
    m.list_keys(Some(T), None, u32::MAX).unwrap().into_iter().map(|k| k.key).collect()
}

fn key_info(m: &Master, key: &str) -> KeyInfo {
    let mut v = m.list_keys(Some(T), Some(&regex::escape(key)), u32::MAX).unwrap();
    assert_eq!(v.len(), 1, "key {key} should be listed once");
    v.pop().unwrap()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn soft(ttl: Option<u64>) -> ReplicateConfig {
    ReplicateConfig { soft_pin_action: SoftPinAction::Enable, soft_pin_ttl_ms: ttl, ..Default::default() }
}

// ---- 1. put-if-absent ----------------------------------------------------------------------

#[test]
fn put_is_put_if_absent_single_and_batch() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    mount(m, B, 2, MIB);

    let first = start(m, A, "k", 4096).unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].len, 4096);
    finish(m, A, "k", true).unwrap();
    let before = get(m, "k").unwrap();
    assert_eq!(before.size, 4096);
    assert_eq!(before.replicas, first);
    let used_before = used(m);
    assert!(used_before >= 4096);

    // Another client, and the same client, both see the existing object; nothing changes.
    assert_eq!(start(m, B, "k", 8192), Err(ErrorCode::OBJECT_ALREADY_EXISTS));
    assert_eq!(start(m, A, "k", 4096), Err(ErrorCode::OBJECT_ALREADY_EXISTS));
    let after = get(m, "k").unwrap();
    assert_eq!(after.size, 4096);
    assert_eq!(after.replicas, before.replicas);
    assert_eq!(used(m), used_before);
    assert_eq!(objects(m), 1);

    // Batch form: one result per item, in request order.
    let req = bws(BatchWriteStart {
        client: B,
        tenant: T.into(),
        items: vec![
            (kref("new-1"), 1000),
            (kref("k"), 2000),
            (kref(""), 3000),
            (kref("new-2"), 4000),
            (kref("zero"), 0),
        ],
        config: ReplicateConfig::default(),
        write_ids: Vec::new(),
    });
    let res = m.batch_write_start(WriteMode::Put, &req);
    assert_eq!(res.len(), 5);
    let r0 = res[0].as_ref().expect("new-1 starts");
    assert_eq!(r0.len(), 1);
    assert_eq!(r0[0].len, 1000);
    assert_eq!(res[1], Err(ErrorCode::OBJECT_ALREADY_EXISTS));
    assert_eq!(res[2], Err(ErrorCode::INVALID_KEY));
    let r3 = res[3].as_ref().expect("new-2 starts");
    assert_eq!(r3[0].len, 4000);
    assert_eq!(res[4], Err(ErrorCode::INVALID_PARAMS));
    assert_ne!((r0[0].segment, r0[0].offset), (r3[0].segment, r3[0].offset));

    // Started but not ended: invisible.
    assert_eq!(get(m, "new-1").err(), Some(ErrorCode::REPLICA_IS_NOT_READY));
    assert_eq!(objects(m), 3);

    let fin = units(m.batch_write_finish(
        &bwf(BatchWriteFinish {
            client: B,
            tenant: T.into(),
            keys: vec![kref("new-1"), kref("k"), kref("new-2")],
            write_ids: Vec::new(),
        }),
        true,
    ));
    assert_eq!(fin.len(), 3);
    assert_eq!(fin[0], Ok(()));
    // "k" was committed by A and has no write in progress: B has no write of it to end.
    assert_eq!(fin[1], Err(ErrorCode::WRITE_DROPPED));
    assert_eq!(fin[2], Ok(()));
    assert_eq!(get(m, "new-1").unwrap().size, 1000);
    assert_eq!(get(m, "new-2").unwrap().size, 4000);
    let k = get(m, "k").unwrap();
    assert_eq!((k.size, k.replicas), (4096, before.replicas));
}

// ---- 2. upsert -----------------------------------------------------------------------------

#[test]
fn upsert_replaces_revoke_keeps_old_and_missing_key_is_created() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    put(m, A, "k", 4096);
    assert_eq!(used(m), 4096);

    // A reader takes a lease on the old value.
    let old = get(m, "k").unwrap();
    let d = m.write_start(WriteMode::Upsert, &ws(A, "k", 8192, ReplicateConfig::default())).unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].len, 8192);
    assert_eq!(used(m), 4096 + 8192);
    // While the upsert is in flight, readers still see the old value and a put still conflicts.
    assert_eq!(get(m, "k").unwrap(), old);
    let other_put = WriteStart { write_id: 77, ..ws(A, "k", 100, ReplicateConfig::default()) };
    assert_eq!(m.write_start(WriteMode::Put, &other_put), Err(ErrorCode::OBJECT_ALREADY_EXISTS));
    // A start repeated with the same write id (its answer was lost) gets the same ranges.
    assert_eq!(m.write_start(WriteMode::Upsert, &ws(A, "k", 8192, ReplicateConfig::default())), Ok(d.clone()));
    assert_eq!(used(m), 4096 + 8192);
    // UpsertEnd.
    m.write_finish(&wf(A, "k"), true).unwrap();
    let new = get(m, "k").unwrap();
    assert_eq!(new.size, 8192);
    assert_eq!(new.replicas, d);
    assert_eq!(objects(m), 1);
    // The old range is free at once, lease or not (readers check generations).
    assert_eq!(used(m), 8192);
    assert_ne!(new.replicas[0].gen, old.replicas[0].gen);

    // UpsertRevoke: the old value stays, the new range is freed at once.
    let d2 = m.write_start(WriteMode::Upsert, &ws(A, "k", 16384, ReplicateConfig::default())).unwrap();
    assert_eq!(d2[0].len, 16384);
    assert_eq!(used(m), 8192 + 16384);
    m.write_finish(&wf(A, "k"), false).unwrap();
    let still = get(m, "k").unwrap();
    assert_eq!(still.size, 8192);
    assert_eq!(still.replicas, d);
    assert_eq!(used(m), 8192);

    // Upsert of a missing key creates it.
    assert_eq!(get(m, "fresh").err(), Some(ErrorCode::OBJECT_NOT_FOUND));
    m.write_start(WriteMode::Upsert, &ws(A, "fresh", 2048, ReplicateConfig::default())).unwrap();
    assert_eq!(get(m, "fresh").err(), Some(ErrorCode::REPLICA_IS_NOT_READY));
    m.write_finish(&wf(A, "fresh"), true).unwrap();
    assert_eq!(get(m, "fresh").unwrap().size, 2048);
    assert_eq!(objects(m), 2);

    // Upsert of a key whose first write is still in progress (and younger than the discard
    // timeout) is refused.
    start(m, A, "busy", 64).unwrap();
    assert_eq!(
        m.write_start(WriteMode::Upsert, &WriteStart { write_id: 78, ..ws(A, "busy", 64, ReplicateConfig::default()) }),
        Err(ErrorCode::REPLICA_IS_NOT_READY)
    );

    // Soft pin: PRESERVE keeps the pin, DISABLE clears it.
    put_cfg(m, A, "pinned", 64, soft(None));
    assert!(key_info(m, "pinned").soft_pinned);
    let preserve = ReplicateConfig { soft_pin_action: SoftPinAction::Preserve, ..Default::default() };
    m.write_start(WriteMode::Upsert, &ws(A, "pinned", 128, preserve)).unwrap();
    m.write_finish(&wf(A, "pinned"), true).unwrap();
    assert!(key_info(m, "pinned").soft_pinned);
    m.write_start(WriteMode::Upsert, &ws(A, "pinned", 64, ReplicateConfig::default())).unwrap();
    m.write_finish(&wf(A, "pinned"), true).unwrap();
    assert!(!key_info(m, "pinned").soft_pinned);
}

// ---- 3. writer identity, in-progress reads, revoke frees ----------------------------------

/// Issue 10, item 3: ends and revokes carry the write id. Another thread of the same client
/// (another write id) can neither commit nor revoke a write that is not its own, and a late
/// revoke of a dropped write cannot free the ranges of the write that replaced it.
#[test]
fn ends_and_revokes_commit_or_free_only_the_write_they_name() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    put(m, A, "k", 4096);
    let up = |id: u64, size: u64| WriteStart { write_id: id, ..ws(A, "k", size, ReplicateConfig::default()) };
    let fin = |id: u64| WriteFinish { write_id: id, ..wf(A, "k") };
    let first = m.write_start(WriteMode::Upsert, &up(1, 8192)).unwrap();
    // A second upsert from another thread of the same client waits for the first.
    assert_eq!(m.write_start(WriteMode::Upsert, &up(2, 100)), Err(ErrorCode::REPLICA_IS_NOT_READY));
    // Its (retried) end or revoke names write 2: neither commits nor frees write 1.
    assert_eq!(m.write_finish(&fin(2), true), Err(ErrorCode::WRITE_DROPPED));
    assert_eq!(m.write_finish(&fin(2), false), Err(ErrorCode::WRITE_DROPPED));
    assert_eq!(used(m), 4096 + 8192);
    assert_eq!(get(m, "k").unwrap().size, 4096);
    // Write 1 commits; its version is its id; a repeated end is harmless, a late revoke is refused.
    let old = get(m, "k").unwrap().replicas;
    let replaced = m.write_finish(&fin(1), true).unwrap();
    assert_eq!(replaced, old, "the end names the replaced value's ranges, to retire");
    let now = get(m, "k").unwrap();
    assert_eq!((now.size, now.replicas.clone()), (8192, first));
    assert_eq!(m.write_finish(&fin(1), true), Ok(old), "a repeated end gets the same ranges to retire");
    assert_eq!(m.write_finish(&fin(1), false), Err(ErrorCode::INVALID_WRITE));
    assert_eq!(used(m), 8192);
    // A write id of 0 is refused.
    assert_eq!(m.write_start(WriteMode::Upsert, &up(0, 64)), Err(ErrorCode::INVALID_PARAMS));
}

/// Issue 10: a client holds at most `max_pending_writes_per_client` unfinished writes; every
/// way a pending write ends (commit, revoke, pre-emption) gives its slot back.
#[test]
fn unfinished_writes_per_client_are_capped() {
    let e = Env::with(MasterConfig { max_pending_writes_per_client: 3, ..MasterConfig::default() });
    let m = &e.m;
    mount(m, A, 1, MIB);
    m.remount_segments(B, vec![]).unwrap();
    for k in ["a", "b", "c"] {
        start(m, A, k, 64).unwrap();
    }
    assert_eq!(start(m, A, "d", 64), Err(ErrorCode::TOO_MANY_PENDING_WRITES));
    let batch = bws(BatchWriteStart {
        client: A,
        tenant: T.into(),
        items: vec![(kref("d"), 64)],
        config: Default::default(),
        write_ids: Vec::new(),
    });
    assert_eq!(m.batch_write_start(WriteMode::Put, &batch), vec![Err(ErrorCode::TOO_MANY_PENDING_WRITES)]);
    // Another client is not affected.
    start(m, B, "d", 64).unwrap();
    finish(m, A, "a", true).unwrap();
    finish(m, A, "b", false).unwrap();
    start(m, A, "e", 64).unwrap();
    start(m, A, "f", 64).unwrap();
    assert_eq!(start(m, A, "g", 64), Err(ErrorCode::TOO_MANY_PENDING_WRITES));
    // B pre-empts A's stale write of "c": A gets its slot back.
    e.advance(DEFAULT_PUT_START_DISCARD_MS);
    e.tick_alive(&[A, B]);
    m.write_start(WriteMode::Upsert, &ws(B, "c", 64, Default::default())).unwrap();
    start(m, A, "g", 64).unwrap();
}

/// Issue 10, item 2: an upsert whose only segment goes away before its end is not acknowledged:
/// the end says WRITE_DROPPED and the old value stays.
#[test]
fn an_upsert_dropped_by_an_unmount_is_not_acknowledged() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    mount(m, B, 2, MIB);
    let on_1 = ReplicateConfig { preferred_segments: vec!["seg-1".into()], ..Default::default() };
    let on_2 = ReplicateConfig { preferred_segments: vec!["seg-2".into()], ..Default::default() };
    put_cfg(m, A, "k", 4096, on_1);
    let d = m.write_start(WriteMode::Upsert, &WriteStart { write_id: 5, ..ws(A, "k", 100, on_2) }).unwrap();
    assert_eq!(d[0].segment, SegmentId(2));
    m.unmount_segment(B, SegmentId(2)).unwrap();
    assert_eq!(m.write_finish(&WriteFinish { write_id: 5, ..wf(A, "k") }, true), Err(ErrorCode::WRITE_DROPPED));
    let now = get(m, "k").unwrap();
    assert_eq!((now.size, now.replicas[0].segment), (4096, SegmentId(1)));
}

/// Issue 10, item 4: the allocator holds as many objects as the memory does. 10,000 one-byte
/// writes fit in a 4 MiB segment (the old node cap refused after 4096), and 600-byte values
/// fill it to more than 90 % of its bytes with no eviction.
#[test]
fn a_segment_fills_with_small_values() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, 4 * MIB);
    for i in 0..10_000 {
        start(m, A, &format!("tiny/{i}"), 1).unwrap_or_else(|err| panic!("start {i}: {err:?}"));
    }
    for i in 0..10_000 {
        finish(m, A, &format!("tiny/{i}"), false).unwrap();
    }
    assert_eq!(used(m), 0);
    // Count what is committed before the first eviction (an allocation failure evicts).
    let mut stored = 0u64;
    for i in 0.. {
        let res = start(m, A, &format!("v/{i}"), 600);
        if m.counters.evicted_objects.load(Ordering::Relaxed) > 0 || res.is_err() {
            break;
        }
        finish(m, A, &format!("v/{i}"), true).unwrap();
        stored += 600;
        assert!(stored <= 4 * MIB, "stored more than the segment holds");
    }
    let fill = stored as f64 / (4 * MIB) as f64;
    assert!(fill > 0.9, "fill ratio {fill}");
}

#[test]
fn only_the_writer_ends_or_revokes_and_revoke_frees_space() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    m.remount_segments(B, vec![]).unwrap();

    start(m, A, "k", 4096).unwrap();
    assert_eq!(used(m), 4096);
    assert_eq!(finish(m, B, "k", true), Err(ErrorCode::WRITE_DROPPED));
    assert_eq!(finish(m, B, "k", false), Err(ErrorCode::WRITE_DROPPED));
    assert_eq!(get(m, "k").err(), Some(ErrorCode::REPLICA_IS_NOT_READY));
    let batch = m.batch_get_replica_list(&BatchKeyQuery { tenant: T.into(), keys: vec![kref("k")] });
    assert_eq!(batch, vec![Err(ErrorCode::REPLICA_IS_NOT_READY)]);
    assert_eq!(exists(m, "k"), Ok(false));
    assert_eq!(remove(m, "k", false), Err(ErrorCode::REPLICA_IS_NOT_READY));
    assert_eq!(objects(m), 1);
    assert_eq!(used(m), 4096);

    finish(m, A, "k", false).unwrap();
    let segs = m.list_segments();
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].used, 0);
    assert_eq!(get(m, "k").err(), Some(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(objects(m), 0);
    assert_eq!(finish(m, A, "k", true), Err(ErrorCode::WRITE_DROPPED));

    // The writer can still end its write after others tried.
    start(m, A, "k2", 512).unwrap();
    assert_eq!(finish(m, B, "k2", true), Err(ErrorCode::WRITE_DROPPED));
    finish(m, A, "k2", true).unwrap();
    assert_eq!(get(m, "k2").unwrap().size, 512);
    // A retried end of a committed write is harmless.
    assert_eq!(finish(m, A, "k2", true), Ok(()));
}

// ---- 4. read leases and removal -------------------------------------------------------------

#[test]
fn read_lease_blocks_remove_until_expiry_or_force() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);

    put(m, A, "k", 4096);
    let r = get(m, "k").unwrap();
    assert_eq!(r.lease_ttl_ms, LEASE);
    assert_eq!(remove(m, "k", false), Err(ErrorCode::OBJECT_HAS_LEASE));
    e.advance(LEASE - 1);
    assert_eq!(remove(m, "k", false), Err(ErrorCode::OBJECT_HAS_LEASE));
    e.advance(2);
    assert_eq!(remove(m, "k", false), Ok(()));
    assert_eq!(get(m, "k").err(), Some(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(used(m), 0);

    // Force removes a leased object at once, and its range is free at once: a reader still
    // copying it finds its generation changed if the range is reused (tycho-transfer's tests).
    put(m, A, "f", 4096);
    get(m, "f").unwrap();
    assert_eq!(remove(m, "f", true), Ok(()));
    assert_eq!(get(m, "f").err(), Some(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(objects(m), 0);
    assert_eq!(used(m), 0);

    // ExistKey grants a lease too.
    put(m, A, "x", 64);
    assert_eq!(exists(m, "x"), Ok(true));
    assert_eq!(exists(m, "nope"), Ok(false));
    assert_eq!(remove(m, "x", false), Err(ErrorCode::OBJECT_HAS_LEASE));
    let be = m.batch_exist_key(&BatchKeyQuery { tenant: T.into(), keys: vec![kref("x")] });
    assert_eq!(be, vec![Ok(true)]);
    e.advance(LEASE + 1);
    assert_eq!(remove(m, "x", false), Ok(()));
}

#[test]
fn remove_all_and_remove_by_regex() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    const T2: &str = "tenant-b";

    put(m, A, "a", 64);
    put(m, A, "b", 64);
    put(m, A, "c", 64);
    get(m, "a").unwrap();
    assert_eq!(m.remove_all(false), 2);
    assert_eq!(keys(m), set(&["a"]));
    assert_eq!(m.remove_all(true), 1);
    assert_eq!(objects(m), 0);

    // remove_by_regex: tenant-scoped, whole-key match, bad regex changes nothing.
    for k in ["kv/1", "kv/2", "kv/x/3", "other"] {
        put(m, A, k, 64);
        // The same keys in another tenant.
        let d = m
            .write_start(
                WriteMode::Put,
                &WriteStart {
                    client: A,
                    tenant: T2.into(),
                    key: kref_in(T2, k),
                    size: 64,
                    config: Default::default(),
                    write_id: 9,
                },
            )
            .unwrap();
        assert_eq!(d.len(), 1);
        m.write_finish(&WriteFinish { client: A, tenant: T2.into(), key: kref_in(T2, k), write_id: 9 }, true).unwrap();
    }
    assert_eq!(objects(m), 8);
    // "kv/1)|(.*" is not a valid regex; naively wrapped as "^(?:kv/1)|(.*)$" it would match
    // every key.
    // Too long, or compiling past the size limit (a counted repetition of a large class), is
    // refused too: a pattern cannot buy unbounded memory or time.
    let long = "a".repeat(tycho_master::MAX_REGEX_LEN + 1);
    let huge = r"(\w{100}){100}";
    for bad in ["(", "kv/[", "kv/1)|(.*", "*", long.as_str(), huge] {
        assert_eq!(m.remove_by_regex(T, bad, true), Err(ErrorCode::INVALID_PARAMS), "regex {bad:?}");
        assert_eq!(objects(m), 8, "regex {bad:?} removed something");
        assert_eq!(m.list_keys(Some(T), Some(bad), 100), Err(ErrorCode::INVALID_PARAMS), "regex {bad:?}");
    }
    // Partial matches do not count: "kv" matches no whole key.
    assert_eq!(m.remove_by_regex(T, "kv", false), Ok(0));
    // A leased matching key is skipped unless forced.
    get(m, "kv/2").unwrap();
    assert_eq!(m.remove_by_regex(T, "kv/[0-9]+", false), Ok(1));
    assert_eq!(keys(m), set(&["kv/2", "kv/x/3", "other"]));
    assert_eq!(m.remove_by_regex(T, "kv/.*", true), Ok(2));
    assert_eq!(keys(m), set(&["other"]));
    // The other tenant is untouched.
    let t2: BTreeSet<String> = m.list_keys(Some(T2), None, 100).unwrap().into_iter().map(|k| k.key).collect();
    assert_eq!(t2, set(&["kv/1", "kv/2", "kv/x/3", "other"]));
    assert_eq!(objects(m), 5);
}

// ---- 5. parameter validation ---------------------------------------------------------------

#[test]
fn invalid_writes_are_rejected_and_change_nothing() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    put(m, A, "existing", 4096);
    let (objs, used0) = (objects(m), used(m));

    let long_key = "x".repeat(MAX_KEY_LEN + 1);
    let cases: Vec<(&str, String, u64, ReplicateConfig, ErrorCode)> = vec![
        ("enable ttl 0", "k".into(), 64, soft(Some(0)), ErrorCode::INVALID_PARAMS),
        ("enable ttl > 24h", "k".into(), 64, soft(Some(MAX_SOFT_PIN_TTL_MS + 1)), ErrorCode::INVALID_PARAMS),
        (
            "disable with ttl",
            "k".into(),
            64,
            ReplicateConfig {
                soft_pin_action: SoftPinAction::Disable,
                soft_pin_ttl_ms: Some(1000),
                ..Default::default()
            },
            ErrorCode::INVALID_PARAMS,
        ),
        (
            "preserve with ttl",
            "k".into(),
            64,
            ReplicateConfig {
                soft_pin_action: SoftPinAction::Preserve,
                soft_pin_ttl_ms: Some(1000),
                ..Default::default()
            },
            ErrorCode::INVALID_PARAMS,
        ),
        (
            "replica_num 0",
            "k".into(),
            64,
            ReplicateConfig { replica_num: 0, ..Default::default() },
            ErrorCode::INVALID_PARAMS,
        ),
        (
            "replica_num 17",
            "k".into(),
            64,
            ReplicateConfig { replica_num: 17, ..Default::default() },
            ErrorCode::INVALID_PARAMS,
        ),
        ("size 0", "k".into(), 0, ReplicateConfig::default(), ErrorCode::INVALID_PARAMS),
        ("empty key", String::new(), 64, ReplicateConfig::default(), ErrorCode::INVALID_KEY),
        ("key of 4097 bytes", long_key, 64, ReplicateConfig::default(), ErrorCode::INVALID_KEY),
        // Validation comes before the existence check.
        ("existing key, size 0", "existing".into(), 0, ReplicateConfig::default(), ErrorCode::INVALID_PARAMS),
    ];
    for (what, key, size, cfg, want) in &cases {
        for mode in [WriteMode::Put, WriteMode::Upsert] {
            let got = m.write_start(mode, &ws(A, key, *size, cfg.clone()));
            assert_eq!(got, Err(*want), "{what} ({mode:?})");
            assert_eq!(objects(m), objs, "{what} ({mode:?}) changed the object count");
            assert_eq!(used(m), used0, "{what} ({mode:?}) changed used bytes");
        }
        // The batch form rejects the same items.
        let req = bws(BatchWriteStart {
            client: A,
            tenant: T.into(),
            items: vec![(kref(key), *size)],
            config: cfg.clone(),
            write_ids: Vec::new(),
        });
        assert_eq!(m.batch_write_start(WriteMode::Put, &req), vec![Err(*want)], "{what} (batch)");
        assert_eq!(objects(m), objs);
        assert_eq!(used(m), used0);
    }
    assert_eq!(get(m, "existing").unwrap().size, 4096);

    // Accepted forms.
    put_cfg(m, A, "soft-default", 64, soft(None));
    let info = key_info(m, "soft-default");
    assert!(info.soft_pinned);
    put_cfg(m, A, "soft-max", 64, soft(Some(MAX_SOFT_PIN_TTL_MS)));
    put(m, A, &"y".repeat(MAX_KEY_LEN), 64);
    assert_eq!(objects(m), objs + 3);
    // The default soft-pin TTL is 30 min.
    e.advance(DEFAULT_SOFT_PIN_TTL_MS - 1);
    assert!(key_info(m, "soft-default").soft_pinned);
    e.advance(1);
    assert!(!key_info(m, "soft-default").soft_pinned);
    assert!(key_info(m, "soft-max").soft_pinned);
}

// ---- 6. eviction ---------------------------------------------------------------------------

const OBJ: u64 = 64 * KIB;

#[test]
fn eviction_takes_oldest_lease_first_and_respects_pins_leases_and_writes() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    for k in ["o0", "o1", "o2", "o3", "o4", "leased"] {
        put(m, A, k, OBJ);
    }
    put_cfg(m, A, "hard", OBJ, ReplicateConfig { hard_pin: true, ..Default::default() });
    put_cfg(m, A, "soft", OBJ, soft(None));
    start(m, A, "pending", OBJ).unwrap();
    assert_eq!(used(m), 9 * OBJ);

    // Reads at different times; the pinned objects get the oldest leases of all.
    for k in ["hard", "soft", "leased"] {
        get(m, k).unwrap();
    }
    let order = ["o3", "o1", "o4", "o0", "o2"];
    for k in order {
        e.advance(1000);
        get(m, k).unwrap();
    }
    e.advance(LEASE + 1);
    // Only this one is leased now.
    get(m, "leased").unwrap();

    let mut left = keys(m);
    for victim in order {
        assert_eq!(m.evict(), (1, OBJ), "evicting {victim}");
        left.remove(victim);
        assert_eq!(keys(m), left, "expected {victim} to be evicted");
    }
    assert_eq!(used(m), 4 * OBJ);
    // Only the soft-pinned object is left among the evictable ones.
    assert_eq!(m.evict(), (1, OBJ));
    left.remove("soft");
    assert_eq!(keys(m), set(&["hard", "leased", "pending"]));
    // Leased, hard-pinned and in-progress objects stay.
    assert_eq!(m.evict(), (0, 0));
    assert_eq!(keys(m), left);
    e.advance(LEASE + 1);
    assert_eq!(m.evict(), (1, OBJ));
    assert_eq!(keys(m), set(&["hard", "pending"]));
    e.advance(DEFAULT_PUT_START_DISCARD_MS);
    assert_eq!(m.evict(), (0, 0));
    assert_eq!(keys(m), set(&["hard", "pending"]));
    assert_eq!(used(m), 2 * OBJ);
    assert_eq!(m.counters.evicted_objects.load(Ordering::Relaxed), 7);
    assert_eq!(m.counters.evicted_bytes.load(Ordering::Relaxed), 7 * OBJ);
}

/// Issue 10, item 5: a write that finds no room asks the background evictor for the bytes it
/// needs (at least 1 % of the capacity) and waits for that round, instead of evicting 5 % of
/// the cache on its own thread; a value larger than any segment fails at once, evicting nothing.
#[test]
fn a_full_segment_evicts_the_bytes_needed_on_the_evictor_thread() {
    let e = Env::new();
    let m = Arc::new(Master::new(MasterConfig::default(), e.clock.clone()));
    mount(&m, A, 1, MIB);
    for i in 0..256 {
        put(&m, A, &format!("o{i:03}"), 4096);
    }
    assert_eq!(used(&m), MIB);
    assert_eq!(start(&m, A, "huge", 2 * MIB), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    assert_eq!(m.counters.eviction_rounds.load(Ordering::Relaxed), 0);
    let evictor = {
        let m = m.clone();
        std::thread::Builder::new().name("evictor".into()).spawn(move || m.run_evictor()).unwrap()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !m.evictor_running() {
        assert!(std::time::Instant::now() < deadline, "the evictor thread did not start");
        std::thread::yield_now();
    }
    // The RPC path does not wait: it fails at once and is retried where waiting is allowed.
    assert_eq!(
        m.write_start_with(WriteMode::Put, &ws(A, "new", 4096, Default::default()), false),
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    );
    put(&m, A, "new", 4096);
    assert_eq!(m.counters.eviction_rounds.load(Ordering::Relaxed), 1);
    // 1 % of 1 MiB is 10,486 bytes: three 4 KiB objects, not 5 % of 256.
    assert_eq!(m.counters.evicted_objects.load(Ordering::Relaxed), 3);
    m.stop_evictor();
    evictor.join().unwrap();
}

#[test]
fn allocation_failure_evicts_then_succeeds() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    let names: Vec<String> = (0..16).map(|i| format!("f{i:02}")).collect();
    for k in &names {
        put(m, A, k, OBJ);
    }
    assert_eq!(used(m), MIB, "segment should be exactly full");

    // All leased: nothing can be evicted, so the write fails and nothing is lost.
    for k in &names {
        get(m, k).unwrap();
    }
    assert_eq!(start(m, A, "extra", OBJ), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    assert_eq!(objects(m), 16);
    assert_eq!(m.counters.evicted_objects.load(Ordering::Relaxed), 0);

    // Leases taken in order f05, f00, f01, ... so f05 is the oldest once all expire.
    e.advance(LEASE + 1);
    get(m, "f05").unwrap();
    for k in names.iter().filter(|k| *k != "f05") {
        e.advance(10);
        get(m, k).unwrap();
    }
    e.advance(LEASE + 1);
    put(m, A, "extra", OBJ);
    assert_eq!(m.counters.eviction_rounds.load(Ordering::Relaxed), 1);
    assert_eq!(m.counters.evicted_objects.load(Ordering::Relaxed), 1);
    let mut want: BTreeSet<String> = names.iter().cloned().collect();
    want.remove("f05");
    want.insert("extra".into());
    assert_eq!(keys(m), want);
    assert_eq!(used(m), MIB);
}

#[test]
fn tick_evicts_above_high_watermark() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    for i in 0..14 {
        put(m, A, &format!("w{i}"), OBJ);
    }
    // 14/16 = 87.5 %: below the watermark.
    e.tick_alive(&[A]);
    assert_eq!(objects(m), 14);
    assert_eq!(m.counters.eviction_rounds.load(Ordering::Relaxed), 0);
    put(m, A, "w14", OBJ);
    // 15/16 = 93.75 % > 90 %.
    e.tick_alive(&[A]);
    assert_eq!(m.counters.eviction_rounds.load(Ordering::Relaxed), 1);
    assert_eq!(objects(m), 14);
    assert_eq!(used(m), 14 * OBJ);
    e.tick_alive(&[A]);
    assert_eq!(m.counters.eviction_rounds.load(Ordering::Relaxed), 1);
    assert_eq!(objects(m), 14);
}

/// PutStart + PutEnd of `names` in one batch of each.
fn batch_put(m: &Master, client: ClientId, names: &[&str], size: u64) {
    let start = bws(BatchWriteStart {
        client,
        tenant: T.into(),
        items: names.iter().map(|k| (kref(k), size)).collect(),
        config: ReplicateConfig::default(),
        write_ids: Vec::new(),
    });
    assert!(m.batch_write_start(WriteMode::Put, &start).iter().all(|r| r.is_ok()));
    let end = bwf(BatchWriteFinish {
        client,
        tenant: T.into(),
        keys: names.iter().map(|k| kref(k)).collect(),
        write_ids: Vec::new(),
    });
    assert!(m.batch_write_finish(&end, true).iter().all(|r| r.is_ok()));
}

fn batch_q(names: &[&str]) -> BatchKeyQuery {
    BatchKeyQuery { tenant: T.into(), keys: names.iter().map(|k| kref(k)).collect() }
}

/// Runs watermark rounds of one object each (fewer than 20 evictable objects) until `n` objects
/// went, and returns them in the order they went.
fn evicted_in_order(m: &Master, n: usize) -> Vec<String> {
    let mut order = Vec::new();
    for _ in 0..n {
        let before = keys(m);
        assert_eq!(m.evict().0, 1);
        order.extend(before.difference(&keys(m)).cloned());
    }
    order
}

fn with_policy(policy: EvictionPolicy) -> Env {
    Env::with(MasterConfig { eviction_policy: policy, ..MasterConfig::default() })
}

/// Issue 44: a stream of puts is evicted in the order it was written, a batch from its last key
/// back (the end of a prefix chain before its start), whatever the clock says: here it never
/// moves, so every object was written in the same millisecond.
#[test]
fn puts_are_evicted_in_write_order_and_a_batch_from_its_end_at_one_instant() {
    for policy in EvictionPolicy::ALL {
        let e = with_policy(policy);
        let m = &e.m;
        mount(m, A, 1, MIB);
        put(m, A, "p0", OBJ);
        batch_put(m, A, &["c0", "c1", "c2"], OBJ);
        put(m, A, "p1", OBJ);
        batch_put(m, A, &["d0", "d1"], OBJ);
        assert_eq!(evicted_in_order(m, 7), ["p0", "c2", "c1", "c0", "p1", "d1", "d0"], "{policy}");
    }
}

/// Issue 44: reads and existence checks are uses: the least recently used object goes first,
/// and a batch's uses are numbered from its end too. Leases end before each round.
#[test]
fn reads_and_existence_checks_move_an_object_to_the_back() {
    for policy in EvictionPolicy::ALL {
        let e = with_policy(policy);
        let m = &e.m;
        mount(m, A, 1, MIB);
        batch_put(m, A, &["a", "b", "c", "d", "e"], OBJ);
        // Written order is e, d, c, b, a (oldest first). Then: a read of d, an existence check
        // of e, a batch check of [b, c] (numbered c, then b), a batch read of [a].
        get(m, "d").unwrap();
        assert_eq!(exists(m, "e"), Ok(true));
        assert!(m.batch_exist_key(&batch_q(&["b", "c"])).iter().all(|r| *r == Ok(true)));
        assert!(m.batch_get_replica_list(&batch_q(&["a"])).iter().all(|r| r.is_ok()));
        e.advance(LEASE + 1);
        // Every object was used since the last round: no lifetime is measured yet, so both
        // policies are least recently used first.
        assert_eq!(evicted_in_order(m, 5), ["d", "e", "c", "b", "a"], "{policy}");
        let by_queue = &m.counters.evicted_by[EvictReason::Watermark as usize];
        let count = |q: EvictQueue| by_queue[q as usize].load(Ordering::Relaxed);
        assert_eq!((count(EvictQueue::Unread), count(EvictQueue::Read), count(EvictQueue::SoftPinned)), (3, 2, 0));
    }
}

/// Issue 44: once a round has measured how long unread objects last, the reuse policy keeps an
/// object that was read longer than objects written after it that nobody read; LRU does not.
/// An existence check is no read: it moves an object back, without the credit.
#[test]
fn the_reuse_policy_keeps_read_objects_past_later_unread_ones() {
    let run = |policy| {
        let e = with_policy(policy);
        let m = &e.m;
        mount(m, A, 1, MIB);
        put(m, A, "old", OBJ);
        put(m, A, "read", OBJ);
        put(m, A, "checked", OBJ);
        get(m, "read").unwrap();
        assert_eq!(exists(m, "checked"), Ok(true));
        for k in ["n0", "n1", "n2", "n3"] {
            put(m, A, k, OBJ);
        }
        e.advance(LEASE + 1);
        let order = evicted_in_order(m, 3);
        assert!(keys(m).contains("n3"));
        order
    };
    assert_eq!(run(EvictionPolicy::Lru), ["old", "read", "checked"]);
    // Uses: old 1, read 2, checked 3, the read 4, the check 5, n0..n3 6..9. The first round
    // takes "old", unread, 9 uses before the next one (10): "read" then ranks as use 4 + 9,
    // behind every later object, until rounds with no new uses shrink the measured lifetime.
    assert_eq!(run(EvictionPolicy::Reuse), ["old", "checked", "n0"]);
}

/// Issue 44: each KVPT group numbers its own uses and is evicted by its own order: a watermark
/// round takes the least recently used objects of every group.
#[test]
fn with_several_groups_each_is_evicted_in_its_own_order() {
    let e = Env::with(MasterConfig { group_count: 2, ..MasterConfig::default() });
    let m = &e.m;
    mount(m, A, 1, 64 * MIB);
    let names: Vec<String> = (0..24).map(|i| format!("k{i:02}")).collect();
    for k in &names {
        put(m, A, k, 1000);
    }
    let rank = |k: &str| tycho_routing::kvpt_to_rank(kref(k).route.partition_id, 2);
    let in_group = |g: u32| names.iter().filter(|k| rank(k) == g).cloned().collect::<Vec<_>>();
    let (g0, g1) = (in_group(0), in_group(1));
    // (At most 20 in a group, so that 5 % of it rounds up to one object.)
    assert!((2..=20).contains(&g0.len()) && (2..=20).contains(&g1.len()), "{} and {}", g0.len(), g1.len());
    // The first-written object of each group is read: in each, the second goes first.
    get(m, &g0[0]).unwrap();
    get(m, &g1[0]).unwrap();
    e.advance(LEASE + 1);
    assert_eq!(m.evict().0, 2, "one object (5 % of at most 20, rounded up) from each group");
    assert_eq!(keys(m), names.iter().filter(|k| **k != g0[1] && **k != g1[1]).cloned().collect());
}

// ---- 7. abandoned writes -------------------------------------------------------------------

#[test]
fn stale_write_is_preempted_after_discard_and_its_space_released_later() {
    let e = Env::new();
    let m = &e.m;
    mount(m, C, 1, MIB);
    m.remount_segments(A, vec![]).unwrap();
    m.remount_segments(B, vec![]).unwrap();
    let all = [A, B, C];

    let a = start(m, A, "k", OBJ).unwrap();
    assert_eq!(used(m), OBJ);
    e.advance(DEFAULT_PUT_START_DISCARD_MS - 1);
    // A put of a key another client is still writing loses, as in Mooncake (the client reports
    // it as success); an upsert is told the value is not ready.
    assert_eq!(start(m, B, "k", OBJ), Err(ErrorCode::OBJECT_ALREADY_EXISTS));
    assert_eq!(
        m.batch_write_start(
            WriteMode::Put,
            &bws(BatchWriteStart {
                client: B,
                tenant: T.into(),
                items: vec![(kref("k"), OBJ)],
                config: ReplicateConfig::default(),
                write_ids: Vec::new()
            })
        ),
        vec![Err(ErrorCode::OBJECT_ALREADY_EXISTS)]
    );
    assert_eq!(
        m.write_start(WriteMode::Upsert, &ws(B, "k", OBJ, ReplicateConfig::default())),
        Err(ErrorCode::REPLICA_IS_NOT_READY)
    );
    assert_eq!(used(m), OBJ, "a refused PutStart must not keep its allocation");
    e.advance(1);
    let b = start(m, B, "k", OBJ).unwrap();
    assert_ne!(a[0].offset, b[0].offset, "A may still be writing into its range");
    assert_eq!(m.counters.writes_discarded.load(Ordering::Relaxed), 1);
    assert_eq!(used(m), 2 * OBJ);
    // A lost the write; B owns it now.
    assert!(finish(m, A, "k", true).is_err());
    assert_eq!(get(m, "k").err(), Some(ErrorCode::REPLICA_IS_NOT_READY));
    finish(m, B, "k", true).unwrap();
    assert_eq!(get(m, "k").unwrap().replicas, b);
    assert_eq!(used(m), 2 * OBJ);

    // A's range stays reserved until 600 s after A's start.
    let until_release = DEFAULT_PUT_START_RELEASE_MS - DEFAULT_PUT_START_DISCARD_MS;
    e.advance(until_release - 1);
    e.tick_alive(&all);
    assert_eq!(used(m), 2 * OBJ);
    e.advance(1);
    e.tick_alive(&all);
    assert_eq!(used(m), OBJ);
    assert_eq!(get(m, "k").unwrap().replicas, b);
}

#[test]
fn unfinished_write_is_reclaimed_after_release_timeout() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    put(m, A, "done", 4096);
    start(m, A, "abandoned", OBJ).unwrap();
    // An upsert left unfinished: the old value must survive the reclaim.
    m.write_start(WriteMode::Upsert, &ws(A, "done", 8192, ReplicateConfig::default())).unwrap();
    assert_eq!(used(m), 4096 + OBJ + 8192);
    assert_eq!(objects(m), 2);

    e.advance(DEFAULT_PUT_START_RELEASE_MS - 1);
    e.tick_alive(&[A]);
    assert_eq!(objects(m), 2);
    assert_eq!(get(m, "abandoned").err(), Some(ErrorCode::REPLICA_IS_NOT_READY));
    assert_eq!(used(m), 4096 + OBJ + 8192);

    // The reclaim scan runs at most once a second.
    e.advance(1000);
    e.tick_alive(&[A]);
    assert_eq!(get(m, "abandoned").err(), Some(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(objects(m), 1);
    assert_eq!(used(m), 4096);
    assert_eq!(get(m, "done").unwrap().size, 4096);
    assert_eq!(m.counters.writes_released.load(Ordering::Relaxed), 2);
    // The writer's late end is told its write was dropped.
    assert_eq!(finish(m, A, "abandoned", true), Err(ErrorCode::WRITE_DROPPED));
}

// ---- 8. ping -------------------------------------------------------------------------------

#[test]
fn ping_unknown_client_needs_remount() {
    let e = Env::new();
    let m = &e.m;
    let r = m.ping(A);
    assert_eq!(r.status, ClientStatus::NeedRemount);
    assert_eq!(start(m, A, "k", 64), Err(ErrorCode::CLIENT_NOT_FOUND));
    let batch = bws(BatchWriteStart {
        client: A,
        tenant: T.into(),
        items: vec![(kref("k"), 64)],
        config: Default::default(),
        write_ids: Vec::new(),
    });
    assert_eq!(m.batch_write_start(WriteMode::Put, &batch), vec![Err(ErrorCode::CLIENT_NOT_FOUND)]);
    assert_eq!(objects(m), 0);

    m.remount_segments(A, vec![seg_desc(1, MIB), seg_desc(2, MIB)]).unwrap();
    let r2 = m.ping(A);
    assert_eq!(r2.status, ClientStatus::Ok);
    assert_eq!(r2.master_instance, r.master_instance);
    assert_eq!(m.list_segments().len(), 2);
    assert_eq!(m.stats().clients, 1);
    put(m, A, "k", 64);
    // Remounting again is idempotent.
    m.remount_segments(A, vec![seg_desc(1, MIB), seg_desc(2, MIB)]).unwrap();
    assert_eq!(m.list_segments().len(), 2);
    assert_eq!(get(m, "k").unwrap().size, 64);
}

// ---- 9. client expiry ----------------------------------------------------------------------

/// Issue 10, fill ratio: with the housekeeping tick running, 600-byte and 4 KiB values fill a
/// segment to at least 85 % of its bytes before the first eviction (the high watermark counts
/// the bytes values hold, not their rounding to 64-byte blocks).
#[test]
fn values_fill_85_percent_before_the_first_eviction() {
    for size in [600u64, 4096] {
        let e = Env::new();
        let m = &e.m;
        mount(m, A, 1, 4 * MIB);
        let mut committed = 0u64;
        for i in 0.. {
            if i % 64 == 0 {
                e.tick_alive(&[A]);
            }
            if m.counters.evicted_objects.load(Ordering::Relaxed) > 0 {
                break;
            }
            match start(m, A, &format!("v/{i}"), size) {
                Ok(_) => finish(m, A, &format!("v/{i}"), true).unwrap(),
                Err(err) => panic!("{size}-byte value {i}: {err:?} before any eviction"),
            }
            if m.counters.evicted_objects.load(Ordering::Relaxed) > 0 {
                break;
            }
            committed += size;
        }
        let fill = committed as f64 / (4 * MIB) as f64;
        assert!(fill >= 0.85, "{size}-byte values: fill ratio {fill:.3} before the first eviction");
    }
}

/// Issue 10, item 1: a remount that replaces a live, older incarnation (the master had not
/// expired the client yet) keeps the ranges of writes in flight on it reserved too.
#[test]
fn a_remount_that_replaces_a_live_incarnation_keeps_its_writes_in_flight() {
    let e = Env::new();
    let m = &e.m;
    let d = mount(m, A, 1, 64 * KIB);
    m.remount_segments(B, vec![]).unwrap();
    let w = start(m, B, "w", 4096).unwrap();
    m.remount_segments(A, vec![SegmentDesc { incarnation: 2, ..d }]).unwrap();
    let big = start(m, B, "big", 60 * KIB).unwrap();
    assert_eq!(big[0].incarnation, 2);
    assert!(big[0].offset >= w[0].offset + 4096 || big[0].offset + 60 * KIB <= w[0].offset);
    assert_eq!(start(m, B, "more", 64), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    assert_eq!(finish(m, B, "w", true), Err(ErrorCode::WRITE_DROPPED));
}

/// Issue 10, item 1 (master side): the owner of an expired segment remounts it under a new
/// incarnation; new descriptors carry it (readers of the old one fail their check), and the
/// ranges of writes that were in flight stay reserved until their release timeout, since their
/// writers may still be copying into that memory.
#[test]
fn a_remount_starts_a_new_incarnation_and_keeps_in_flight_write_ranges() {
    let e = Env::new();
    let m = &e.m;
    let d = mount(m, A, 1, 64 * KIB);
    m.remount_segments(B, vec![]).unwrap();
    let w = start(m, B, "w", 4096).unwrap();
    assert_eq!(w[0].incarnation, 1);
    e.advance(DEFAULT_CLIENT_TTL_MS + 1);
    e.tick_alive(&[B]);
    assert_eq!(m.ping(A).status, ClientStatus::NeedRemount);
    m.remount_segments(A, vec![SegmentDesc { incarnation: 2, ..d.clone() }]).unwrap();
    // Everything but W's 4 KiB is free; a value of the rest fits and does not overlap W's range.
    let big = start(m, B, "big", 60 * KIB).unwrap();
    assert_eq!(big[0].incarnation, 2);
    assert!(big[0].offset >= w[0].offset + 4096 || big[0].offset + 60 * KIB <= w[0].offset);
    assert_eq!(start(m, B, "more", 64), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    // W's late end is refused: its segment incarnation is gone.
    assert_eq!(finish(m, B, "w", true), Err(ErrorCode::WRITE_DROPPED));
    // After the release timeout the range is free again.
    e.advance(DEFAULT_PUT_START_RELEASE_MS);
    e.tick_alive(&[A, B]);
    start(m, B, "more", 4096).unwrap();
    // An old incarnation, or another client, cannot take the segment over.
    assert_eq!(m.mount_segment(A, d.clone()), Err(ErrorCode::SEGMENT_ALREADY_EXISTS));
    assert_eq!(m.mount_segment(B, SegmentDesc { incarnation: 3, ..d }), Err(ErrorCode::SEGMENT_ALREADY_EXISTS));
}

#[test]
fn silent_client_expires_and_its_replicas_are_dropped() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    mount(m, B, 2, MIB);
    let on_a = ReplicateConfig { preferred_segments: vec!["seg-1".into()], ..Default::default() };
    let on_both = ReplicateConfig { replica_num: 2, ..Default::default() };
    for i in 0..10 {
        let d = put_cfg(m, B, &format!("both{i}"), 4096, on_both.clone());
        assert_eq!(d.len(), 2);
        let d = put_cfg(m, if i % 2 == 0 { A } else { B }, &format!("only-a{i}"), 4096, on_a.clone());
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].segment, SegmentId(1));
    }
    let used_b = used_of(m, 2).unwrap();
    assert_eq!(used_b, 10 * 4096);

    // B keeps pinging; A falls silent.
    let mut waited = 0;
    while waited < DEFAULT_CLIENT_TTL_MS - 1000 {
        e.advance(1000);
        waited += 1000;
        e.tick_alive(&[B]);
        assert_eq!(m.list_segments().len(), 2, "A expired early, after {waited} ms");
    }
    assert_eq!(m.counters.sweep_visited.load(Ordering::Relaxed), 0);
    e.advance(1000);
    e.tick_alive(&[B]);

    let segs = m.list_segments();
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].desc.id, SegmentId(2));
    assert_eq!(segs[0].client, B);
    assert_eq!(segs[0].used, used_b);
    for i in 0..10 {
        assert_eq!(get(m, &format!("only-a{i}")).err(), Some(ErrorCode::OBJECT_NOT_FOUND));
        let r = get(m, &format!("both{i}")).unwrap();
        assert_eq!(r.replicas.len(), 1);
        assert_eq!(r.replicas[0].segment, SegmentId(2));
        assert_eq!(r.size, 4096);
    }
    assert_eq!(objects(m), 10);
    assert_eq!(m.counters.clients_expired.load(Ordering::Relaxed), 1);
    assert_eq!(m.counters.sweep_visited.load(Ordering::Relaxed), 20);
    assert_eq!(m.counters.sweep_objects_removed.load(Ordering::Relaxed), 10);
    assert_eq!(m.counters.sweep_replicas_dropped.load(Ordering::Relaxed), 20);
    assert_eq!(m.counters.sweeps_running.load(Ordering::Relaxed), 0);
    assert_eq!(m.stats().clients, 1);
    assert_eq!(m.ping(B).status, ClientStatus::Ok);
    assert_eq!(m.ping(A).status, ClientStatus::NeedRemount);
    assert_eq!(start(m, A, "late", 64), Err(ErrorCode::CLIENT_NOT_FOUND));
}

// ---- 10. routing ---------------------------------------------------------------------------

#[test]
fn wrong_routes_are_refused_and_change_nothing() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    put(m, A, "k", 4096);
    let (objs, used0) = (objects(m), used(m));

    for key in ["k", "new"] {
        let good = route_for(T, key, 1);
        let routes = [
            (RouteTag { partition_id: (good.partition_id + 1) % 16384, epoch: 1 }, ErrorCode::STALE_ROUTE),
            // A route computed for another tenant.
            (route_for("other-tenant", key, 1), ErrorCode::STALE_ROUTE),
            (RouteTag { epoch: 0, ..good }, ErrorCode::STALE_EPOCH),
            (RouteTag { epoch: 2, ..good }, ErrorCode::KVPT_NOT_OWNED),
        ];
        assert_ne!(routes[1].0.partition_id, good.partition_id);
        for (route, want) in routes {
            let kr = KeyRef { key: key.into(), route };
            let wst = WriteStart {
                client: A,
                tenant: T.into(),
                key: kr.clone(),
                size: 64,
                config: Default::default(),
                write_id: 9,
            };
            let wfi = WriteFinish { client: A, tenant: T.into(), key: kr.clone(), write_id: 9 };
            let kq = KeyQuery { tenant: T.into(), key: kr.clone() };
            assert_eq!(m.write_start(WriteMode::Put, &wst), Err(want), "{key} {route:?}");
            assert_eq!(m.write_start(WriteMode::Upsert, &wst), Err(want));
            assert_eq!(m.write_finish(&wfi, true), Err(want));
            assert_eq!(m.write_finish(&wfi, false), Err(want));
            assert_eq!(m.get_replica_list(&kq).err(), Some(want));
            assert_eq!(m.exist_key(&kq), Err(want));
            assert_eq!(m.remove(&RemoveKey { tenant: T.into(), key: kr.clone(), force: true }), Err(want));
            let bq = BatchKeyQuery { tenant: T.into(), keys: vec![kr.clone(), kref(key)] };
            let bg = m.batch_get_replica_list(&bq);
            assert_eq!(bg[0].as_ref().err(), Some(&want));
            assert_eq!(bg[1].is_ok(), key == "k");
            let br = m.batch_remove(&BatchRemoveKeys { tenant: T.into(), keys: vec![kr.clone()], force: true });
            assert_eq!(br, vec![Err(want)]);
            let bw = bws(BatchWriteStart {
                client: A,
                tenant: T.into(),
                items: vec![(kr.clone(), 64)],
                config: Default::default(),
                write_ids: Vec::new(),
            });
            assert_eq!(m.batch_write_start(WriteMode::Upsert, &bw), vec![Err(want)]);
            assert_eq!(objects(m), objs);
            assert_eq!(used(m), used0);
        }
    }
    let r = get(m, "k").unwrap();
    assert_eq!(r.size, 4096);
    assert_eq!(keys(m), set(&["k"]));
}

// ---- 11. mount / unmount -------------------------------------------------------------------

#[test]
fn mount_and_unmount_rules() {
    let e = Env::new();
    let m = &e.m;
    let d1 = mount(m, A, 1, MIB);
    // Idempotent.
    m.mount_segment(A, d1.clone()).unwrap();
    assert_eq!(m.list_segments().len(), 1);
    // Same id by another client.
    assert_eq!(m.mount_segment(B, d1.clone()), Err(ErrorCode::SEGMENT_ALREADY_EXISTS));
    // Same id, different description.
    assert_eq!(m.mount_segment(A, SegmentDesc { size: 2 * MIB, ..d1.clone() }), Err(ErrorCode::SEGMENT_ALREADY_EXISTS));
    // Overlapping range on the same endpoint, another id.
    let overlap = SegmentDesc { id: SegmentId(9), name: "seg-9".into(), base: MIB / 2, ..d1.clone() };
    assert_eq!(m.mount_segment(A, overlap), Err(ErrorCode::SEGMENT_ALREADY_EXISTS));
    assert_eq!(m.list_segments().len(), 1);
    // Adjacent range on the same endpoint is fine.
    let adjacent = SegmentDesc { id: SegmentId(3), name: "seg-3".into(), base: MIB, ..d1.clone() };
    m.mount_segment(A, adjacent).unwrap();
    mount(m, B, 2, MIB);
    assert_eq!(m.list_segments().len(), 3);

    // Unmounting an unknown segment succeeds; another client's segment is refused.
    assert_eq!(m.unmount_segment(A, SegmentId(77)), Ok(()));
    assert_eq!(m.unmount_segment(B, SegmentId(1)), Err(ErrorCode::ILLEGAL_CLIENT));
    assert_eq!(m.list_segments().len(), 3);

    let on = |name: &str| ReplicateConfig { preferred_segments: vec![name.into()], ..Default::default() };
    let d = put_cfg(m, A, "only-1", 4096, on("seg-1"));
    assert_eq!(d[0].segment, SegmentId(1));
    let d = put_cfg(m, A, "only-2", 4096, on("seg-2"));
    assert_eq!(d[0].segment, SegmentId(2));
    let both = ReplicateConfig {
        replica_num: 2,
        preferred_segments: vec!["seg-1".into(), "seg-2".into()],
        ..Default::default()
    };
    let d = put_cfg(m, A, "both", 4096, both);
    assert_eq!(d.len(), 2);
    start_cfg(m, A, "pending-1", 4096, on("seg-1")).unwrap();

    assert_eq!(m.unmount_segment(A, SegmentId(1)), Ok(()));
    assert_eq!(used_of(m, 1), None);
    assert_eq!(get(m, "only-1").err(), Some(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(get(m, "pending-1").err(), Some(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(get(m, "only-2").unwrap().replicas[0].segment, SegmentId(2));
    let b = get(m, "both").unwrap();
    assert_eq!(b.replicas.len(), 1);
    assert_eq!(b.replicas[0].segment, SegmentId(2));
    assert_eq!(keys(m), set(&["only-2", "both"]));
    assert_eq!(used_of(m, 2), Some(2 * 4096));
    // Unmounting again is a no-op.
    assert_eq!(m.unmount_segment(A, SegmentId(1)), Ok(()));
    assert_eq!(m.list_segments().len(), 2);
    // The id can be mounted again afterwards.
    m.mount_segment(A, d1).unwrap();
    assert_eq!(m.list_segments().len(), 3);
}

// ---- 12. batch RPCs ------------------------------------------------------------------------

#[test]
fn batch_rpcs_answer_per_key_in_request_order() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, 64 * MIB);
    m.remount_segments(B, vec![]).unwrap();
    let n = 200;
    let name = |i: usize| format!("batch/{i:03}");
    let size = |i: usize| 64 * (i as u64 + 1);
    let shards: BTreeSet<u16> = (0..n).map(|i| route_for(T, &name(i), 1).partition_id % 1024).collect();
    assert!(shards.len() > 150, "keys should spread over many shards, got {}", shards.len());

    // Batch put of 200 keys.
    let items: Vec<(KeyRef, u64)> = (0..n).map(|i| (kref(&name(i)), size(i))).collect();
    let started = m.batch_write_start(
        WriteMode::Put,
        &bws(BatchWriteStart { client: A, tenant: T.into(), items, config: Default::default(), write_ids: Vec::new() }),
    );
    assert_eq!(started.len(), n);
    for (i, r) in started.iter().enumerate() {
        assert_eq!(r.as_ref().unwrap()[0].len, size(i), "start {i}");
    }
    // batch_write_finish in reverse order, mixed with missing and invalid keys and another
    // writer's keys.
    let mut fin_keys = Vec::new();
    let mut fin_want = Vec::new();
    for i in (0..n).rev() {
        fin_keys.push(kref(&name(i)));
        fin_want.push(Ok(()));
        if i % 10 == 0 {
            fin_keys.push(kref(&format!("missing/{i}")));
            fin_want.push(Err(ErrorCode::WRITE_DROPPED));
        }
        if i % 50 == 0 {
            fin_keys.push(kref(""));
            fin_want.push(Err(ErrorCode::INVALID_KEY));
        }
    }
    // Another client may not end A's writes: it has none of its own there.
    let others = units(m.batch_write_finish(
        &bwf(BatchWriteFinish { client: B, tenant: T.into(), keys: fin_keys.clone(), write_ids: Vec::new() }),
        true,
    ));
    let want_b: Vec<WireResult<()>> =
        fin_want.iter().map(|w| if w.is_ok() { Err(ErrorCode::WRITE_DROPPED) } else { *w }).collect();
    assert_eq!(others, want_b);
    let fin = units(m.batch_write_finish(
        &bwf(BatchWriteFinish { client: A, tenant: T.into(), keys: fin_keys, write_ids: Vec::new() }),
        true,
    ));
    assert_eq!(fin, fin_want);
    assert_eq!(objects(m), n as u64);

    // batch_get_replica_list / batch_exist_key: a shuffled order with misses interleaved.
    let order: Vec<usize> = (0..n).map(|j| (j * 37 + 11) % n).collect();
    let mut qkeys = Vec::new();
    let mut expect: Vec<Option<u64>> = Vec::new();
    for (j, &i) in order.iter().enumerate() {
        qkeys.push(kref(&name(i)));
        expect.push(Some(size(i)));
        if j % 7 == 0 {
            qkeys.push(kref(&format!("absent/{j}")));
            expect.push(None);
        }
    }
    let bq = BatchKeyQuery { tenant: T.into(), keys: qkeys.clone() };
    let lists = m.batch_get_replica_list(&bq);
    assert_eq!(lists.len(), expect.len());
    for (j, (got, want)) in lists.iter().zip(&expect).enumerate() {
        match want {
            Some(sz) => {
                let l = got.as_ref().unwrap_or_else(|e| panic!("item {j}: {e:?}"));
                assert_eq!(l.size, *sz, "item {j}");
                assert_eq!(l.replicas[0].len, *sz);
                assert_eq!(l.lease_ttl_ms, LEASE);
            }
            None => assert_eq!(got.as_ref().err(), Some(&ErrorCode::OBJECT_NOT_FOUND), "item {j}"),
        }
    }
    let ex = m.batch_exist_key(&bq);
    let want_ex: Vec<WireResult<bool>> = expect.iter().map(|w| Ok(w.is_some())).collect();
    assert_eq!(ex, want_ex);

    // batch_remove: leased (even) keys refuse, the others go, misses and bad keys say so.
    e.advance(LEASE + 1);
    let even: Vec<KeyRef> = (0..n).filter(|i| i % 2 == 0).map(|i| kref(&name(i))).collect();
    assert!(m.batch_exist_key(&BatchKeyQuery { tenant: T.into(), keys: even }).iter().all(|r| *r == Ok(true)));
    let mut rkeys = Vec::new();
    let mut rwant = Vec::new();
    for &i in &order {
        rkeys.push(kref(&name(i)));
        rwant.push(if i % 2 == 0 { Err(ErrorCode::OBJECT_HAS_LEASE) } else { Ok(()) });
        if i % 40 == 3 {
            rkeys.push(kref(&format!("gone/{i}")));
            rwant.push(Err(ErrorCode::OBJECT_NOT_FOUND));
            rkeys.push(kref_in("someone-else", &name(i)));
            rwant.push(Err(ErrorCode::STALE_ROUTE));
        }
    }
    let removed = m.batch_remove(&BatchRemoveKeys { tenant: T.into(), keys: rkeys.clone(), force: false });
    assert_eq!(removed, rwant);
    assert_eq!(objects(m), n as u64 / 2);
    // Forced: the leased ones go now; the others are already gone.
    let removed = m.batch_remove(&BatchRemoveKeys { tenant: T.into(), keys: rkeys, force: true });
    let want2: Vec<WireResult<()>> = rwant
        .iter()
        .map(|w| {
            if *w == Ok(()) {
                Err(ErrorCode::OBJECT_NOT_FOUND)
            } else if *w == Err(ErrorCode::OBJECT_HAS_LEASE) {
                Ok(())
            } else {
                *w
            }
        })
        .collect();
    assert_eq!(removed, want2);
    assert_eq!(objects(m), 0);

    // Batch revoke answers per key too.
    let items: Vec<(KeyRef, u64)> = (0..n).map(|i| (kref(&name(i)), 64)).collect();
    let started = m.batch_write_start(
        WriteMode::Upsert,
        &bws(BatchWriteStart { client: A, tenant: T.into(), items, config: Default::default(), write_ids: Vec::new() }),
    );
    assert!(started.iter().all(|r| r.is_ok()));
    let half: Vec<KeyRef> = (0..n).filter(|i| i % 2 == 1).map(|i| kref(&name(i))).collect();
    assert!(m
        .batch_write_finish(
            &bwf(BatchWriteFinish { client: A, tenant: T.into(), keys: half, write_ids: Vec::new() }),
            true
        )
        .iter()
        .all(|r| r.is_ok()));
    let all: Vec<KeyRef> = (0..n).map(|i| kref(&name(i))).collect();
    let revoked = units(m.batch_write_finish(
        &bwf(BatchWriteFinish { client: A, tenant: T.into(), keys: all, write_ids: Vec::new() }),
        false,
    ));
    let want_rev: Vec<WireResult<()>> =
        (0..n).map(|i| if i % 2 == 0 { Ok(()) } else { Err(ErrorCode::INVALID_WRITE) }).collect();
    assert_eq!(revoked, want_rev);
    assert_eq!(objects(m), n as u64 / 2);
    // Ranges of objects removed while leased are freed once the leases end.
    e.advance(LEASE + 1);
    e.tick_alive(&[A, B]);
    assert_eq!(used(m), (n as u64 / 2) * 64);
}

// ---- 13. sweep concurrency -----------------------------------------------------------------

/// A client expiring with 200 000 objects on its segment must not freeze readers of other
/// segments: the sweep holds each shard lock for a bounded batch only.
#[test]
fn sweep_does_not_stall_readers_of_other_segments() {
    let e = Env::new();
    let m = &e.m;
    const TOTAL: u64 = 200_000;
    const B_KEYS: usize = 512;
    mount(m, A, 1, 64 * GIB);
    let cfg = ReplicateConfig::default();
    for chunk in 0..(TOTAL / 1000) {
        let items: Vec<(KeyRef, u64)> = (0..1000).map(|i| (kref(&format!("a/{chunk}/{i}")), 4 * KIB)).collect();
        let keys: Vec<KeyRef> = items.iter().map(|(k, _)| k.clone()).collect();
        let req =
            bws(BatchWriteStart { client: A, tenant: T.into(), items, config: cfg.clone(), write_ids: Vec::new() });
        assert!(m.batch_write_start(WriteMode::Put, &req).iter().all(|r| r.is_ok()));
        let fin = bwf(BatchWriteFinish { client: A, tenant: T.into(), keys, write_ids: Vec::new() });
        assert!(units(m.batch_write_finish(&fin, true)).iter().all(|r| r.is_ok()));
    }
    assert_eq!(objects(m), TOTAL);

    mount(m, B, 2, 64 * MIB);
    let on_b = ReplicateConfig { preferred_segments: vec!["seg-2".into()], ..Default::default() };
    let b_keys: Vec<String> = (0..B_KEYS).map(|i| format!("b/{i}")).collect();
    for k in &b_keys {
        let d = put_cfg(m, B, k, 4 * KIB, on_b.clone());
        assert_eq!(d[0].segment, SegmentId(2));
    }

    let reader_started = AtomicBool::new(false);
    let sweep_done = AtomicBool::new(false);
    let (reads, failures, during, distinct_progress) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let (mut reads, mut failures, mut during) = (0u64, 0u64, 0u64);
            let mut progress = BTreeSet::new();
            let mut i = 0;
            loop {
                // Check the flag before the read so that at least one read follows the sweep.
                let finished = sweep_done.load(Ordering::SeqCst);
                let r = get(m, &b_keys[i % B_KEYS]);
                i += 1;
                reads += 1;
                match r {
                    Ok(l) if l.replicas.len() == 1 && l.replicas[0].segment == SegmentId(2) => {}
                    _ => failures += 1,
                }
                let running = m.counters.sweeps_running.load(Ordering::SeqCst);
                let visited = m.counters.sweep_visited.load(Ordering::SeqCst);
                if running > 0 && visited > 0 && visited < TOTAL {
                    during += 1;
                    progress.insert(visited);
                }
                reader_started.store(true, Ordering::SeqCst);
                if finished {
                    break;
                }
            }
            (reads, failures, during, progress.len())
        });
        while !reader_started.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        e.advance(DEFAULT_CLIENT_TTL_MS + 1);
        assert_eq!(m.ping(B).status, ClientStatus::Ok);
        m.tick();
        sweep_done.store(true, Ordering::SeqCst);
        reader.join().unwrap()
    });

    assert_eq!(failures, 0, "{failures} of {reads} reads failed during the sweep");
    assert_eq!(m.counters.sweep_visited.load(Ordering::Relaxed), TOTAL);
    assert_eq!(m.counters.sweep_objects_removed.load(Ordering::Relaxed), TOTAL);
    assert_eq!(m.counters.sweeps_running.load(Ordering::Relaxed), 0);
    assert_eq!(objects(m), B_KEYS as u64);
    assert_eq!(m.list_segments().len(), 1);
    eprintln!("sweep: {reads} reads, {during} during the sweep at {distinct_progress} distinct progress points");
    if std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2 {
        assert!(during > 0, "no read completed while the sweep was running ({reads} reads in all)");
    }
}

fn clear(m: &Master, client: ClientId, keys: &[&str], segment: &str) -> Vec<WireResult<()>> {
    m.batch_replica_clear(&ReplicaClear {
        client,
        tenant: T.into(),
        keys: keys.iter().map(|k| kref(k)).collect(),
        segment: segment.into(),
    })
}

#[test]
fn replica_clear_takes_only_the_callers_unleased_complete_objects() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    mount(m, B, 2, MIB);
    put(m, A, "mine", OBJ);
    put(m, B, "theirs", OBJ);
    put(m, A, "leased", OBJ);
    start(m, A, "pending", OBJ).unwrap();
    get(m, "leased").unwrap();
    let r = clear(m, A, &["mine", "theirs", "leased", "pending", "missing"], "");
    assert_eq!(
        r,
        vec![
            Ok(()),
            Err(ErrorCode::ILLEGAL_CLIENT),
            Err(ErrorCode::OBJECT_HAS_LEASE),
            Err(ErrorCode::REPLICA_IS_NOT_READY),
            Err(ErrorCode::OBJECT_NOT_FOUND),
        ]
    );
    assert_eq!(keys(m), set(&["theirs", "leased", "pending"]));
    e.advance(LEASE + 1);
    assert_eq!(clear(m, A, &["leased"], ""), vec![Ok(())]);
    assert_eq!(keys(m), set(&["theirs", "pending"]));
    // The cleared objects' space is free again: only "theirs" and the pending write hold any.
    assert_eq!(used(m), 2 * OBJ);
}

#[test]
fn replica_clear_on_a_segment_keeps_the_other_replicas() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    mount(m, A, 2, MIB);
    let cfg = ReplicateConfig { replica_num: 2, ..Default::default() };
    assert_eq!(put_cfg(m, A, "two", OBJ, cfg).len(), 2);
    put(m, A, "one", OBJ);
    let one_on = |m: &Master| get(m, "one").unwrap().replicas[0].segment;
    let seg_of_one = one_on(m);
    let other = if seg_of_one == SegmentId(1) { "seg-2" } else { "seg-1" };
    e.advance(LEASE + 1);
    // "one" has no replica on the other segment; "two" loses one of its two.
    assert_eq!(clear(m, A, &["two", "one"], other), vec![Ok(()), Err(ErrorCode::REPLICA_NOT_FOUND)]);
    let left = get(m, "two").unwrap();
    assert_eq!(left.replicas.len(), 1);
    assert_ne!(format!("seg-{}", left.replicas[0].segment.0), other);
    e.advance(LEASE + 1);
    // Clearing the last replica removes the object.
    let last = format!("seg-{}", left.replicas[0].segment.0);
    assert_eq!(clear(m, A, &["two"], &last), vec![Ok(())]);
    assert_eq!(get(m, "two").unwrap_err(), ErrorCode::OBJECT_NOT_FOUND);
    assert_eq!(used(m), OBJ);
}

#[test]
fn soft_pinned_objects_stay_when_eviction_may_not_take_them() {
    let e = Env::with(MasterConfig { allow_evict_soft_pinned_objects: false, ..MasterConfig::default() });
    let m = &e.m;
    mount(m, A, 1, MIB);
    put_cfg(m, A, "soft", OBJ, soft(None));
    assert_eq!(m.evict(), (0, 0));
    assert_eq!(keys(m), set(&["soft"]));
}

/// Issue 11: a master that stalls (its RPC runtime stops noting that it runs, as when every
/// worker is stuck) does not expire clients whose pings waited behind the stall; they get a
/// full TTL from the end of the stall, and one that stays silent after it is expired then.
#[test]
fn client_expiry_waits_while_the_master_itself_is_stalled() {
    let e = Env::new();
    let m = &e.m;
    mount(m, A, 1, MIB);
    mount(m, B, 2, MIB);
    m.note_responsive();
    // Stalled for twice the TTL: nobody pings, the runtime notes nothing.
    for _ in 0..2 * DEFAULT_CLIENT_TTL_MS / 1000 {
        e.advance(1000);
        m.tick();
        assert_eq!(m.list_segments().len(), 2, "a client was expired during the master's own stall");
    }
    assert!(m.counters.expiry_pauses.load(Ordering::Relaxed) > 0);
    // The stall ends: B pings again, A stays silent; A is expired one TTL after the stall.
    let mut waited = 0;
    while waited < DEFAULT_CLIENT_TTL_MS - 1000 {
        e.advance(1000);
        waited += 1000;
        m.note_responsive();
        e.tick_alive(&[B]);
        assert_eq!(m.list_segments().len(), 2, "A expired {waited} ms after the stall");
    }
    e.advance(1000);
    m.note_responsive();
    e.tick_alive(&[B]);
    assert_eq!(m.list_segments().len(), 1);
    assert_eq!(m.counters.clients_expired.load(Ordering::Relaxed), 1);
}

/// Issue 11: with a secret, every descriptor carries a capability the segment's key checks:
/// writes get a write grant; readers of one object share a read grant (one MAC per lease, not
/// per read) that outlasts their lease; a remount's new incarnation makes a new key.
#[test]
fn descriptors_carry_capabilities_and_readers_share_one() {
    use tycho_proto::auth::capability::{SegmentKey, RIGHT_READ, RIGHT_WRITE};
    let secret =
        Arc::new(tycho_proto::auth::Secret::from_text(b"master-test-cluster-secret-of-enough-length").unwrap());
    let e = Env::with(MasterConfig { secret: Some(secret.clone()), ..MasterConfig::default() });
    let m = &e.m;
    mount(m, A, 1, MIB);
    let w = put(m, A, "k", 4096);
    let key = SegmentKey::new(&secret, w[0].segment, w[0].incarnation);
    // Grants are minted on the master's clock, as the Unix time it stands for.
    let now = e.clock.unix_now_ms();
    assert_eq!(key.check(w[0].offset, w[0].len, w[0].gen, &w[0].cap, RIGHT_WRITE, now), Ok(()));
    let r1 = get(m, "k").unwrap().replicas[0].clone();
    let r2 = get(m, "k").unwrap().replicas[0].clone();
    assert_eq!(r1.cap, r2.cap, "readers share the cached grant");
    assert_eq!(key.check(r1.offset, r1.len, r1.gen, &r1.cap, RIGHT_READ, now), Ok(()));
    assert_eq!(key.check(r1.offset, r1.len, r1.gen, &r1.cap, RIGHT_WRITE, now), Err(ErrorCode::CAPABILITY_INVALID));
    assert!(r1.cap.expires_ms >= now + DEFAULT_KV_LEASE_TTL_MS, "the grant outlasts the lease");
    let other = SegmentKey::new(&secret, w[0].segment, w[0].incarnation + 1);
    assert_eq!(other.check(r1.offset, r1.len, r1.gen, &r1.cap, RIGHT_READ, now), Err(ErrorCode::CAPABILITY_INVALID));
    // Without a secret, no capability.
    let plain = Env::new();
    mount(&plain.m, A, 1, MIB);
    assert_eq!(put(&plain.m, A, "k", 4096)[0].cap, Default::default());
}

/// PutStart of `key` by client A for `tenant`, failing at once (no eviction wait) if nothing fits.
fn put_start_as(m: &Master, tenant: &str, key: KeyRef, size: u64) -> WireResult<Vec<ReplicaDesc>> {
    let write_id = wid(A, &key.key);
    let req = WriteStart { client: A, tenant: tenant.into(), key, size, config: ReplicateConfig::default(), write_id };
    m.write_start_with(WriteMode::Put, &req, false)
}

/// Issue 11: with a secret, a freed range stays with its object's tenant while a grant minted
/// for it may still move bytes (its expiry plus twice the allowed clock skew): the tenant reuses
/// it at once, another tenant only afterwards. A replaced value's ranges are handed to their
/// writer with a retire-only grant.
#[test]
fn freed_ranges_stay_with_their_tenant_while_a_grant_may_be_used() {
    use tycho_proto::auth::capability::{CLOCK_SKEW_MS, RIGHT_RETIRE};
    let secret =
        Arc::new(tycho_proto::auth::Secret::from_text(b"master-test-cluster-secret-of-enough-length").unwrap());
    let e = Env::with(MasterConfig { secret: Some(secret), ..MasterConfig::default() });
    let m = &e.m;
    mount(m, A, 1, MIB);
    let start_in = |tenant: &str, key: &str, size: u64| put_start_as(m, tenant, kref_in(tenant, key), size);
    let end_in = |tenant: &str, key: &str| {
        let req = WriteFinish { client: A, tenant: tenant.into(), key: kref_in(tenant, key), write_id: wid(A, key) };
        m.write_finish(&req, true)
    };
    let remove_in = |tenant: &str, key: &str| {
        m.remove(&RemoveKey { tenant: tenant.into(), key: kref_in(tenant, key), force: true })
    };
    let first = start_in("one", "a", MIB).unwrap();
    end_in("one", "a").unwrap();
    remove_in("one", "a").unwrap();
    assert_eq!(used(m), 0, "the space counts as free at once");
    // Tenant two finds no room while tenant one's write grant may still be used...
    assert_eq!(start_in("two", "b", 4 * KIB), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    // ...while tenant one reuses its space at once.
    let again = start_in("one", "c", 512 * KIB).unwrap();
    assert_eq!(again[0].offset, first[0].offset);
    end_in("one", "c").unwrap();
    // Held until the first grant's expiry plus twice the skew and a margin, by the master's clock.
    let until = first[0].cap.expires_ms + HELD_PAST_EXPIRY_MS;
    const { assert!(HELD_PAST_EXPIRY_MS > 2 * CLOCK_SKEW_MS) };
    e.advance(until - e.clock.unix_now_ms() - 1);
    assert_eq!(start_in("two", "b", 4 * KIB), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    e.advance(1);
    let b = start_in("two", "b", 4 * KIB).unwrap();
    assert_eq!(b[0].offset, 512 * KIB, "the rest of tenant one's range is free for all now");
    end_in("two", "b").unwrap();
    // A replaced value's ranges come back with a grant that only retires.
    let req = WriteStart {
        client: A,
        tenant: "two".into(),
        key: kref_in("two", "b"),
        size: 4 * KIB,
        config: ReplicateConfig::default(),
        write_id: wid(A, "b") + 2,
    };
    m.write_start_with(WriteMode::Upsert, &req, false).unwrap();
    let fin = WriteFinish { client: A, tenant: "two".into(), key: kref_in("two", "b"), write_id: wid(A, "b") + 2 };
    let replaced = m.write_finish(&fin, true).unwrap();
    assert_eq!(replaced.len(), 1);
    assert_eq!(replaced[0].offset, b[0].offset);
    assert_eq!(replaced[0].cap.rights, RIGHT_RETIRE);
}

/// A read grant that outlasts the write's (read leases longer than the discard timeout) keeps
/// the range held that long, also through the tenant's own reuse of part of it: the reusing
/// object inherits the hold.
#[test]
fn a_read_grant_holds_the_range_as_long_as_it_lasts_even_through_reuse() {
    let secret =
        Arc::new(tycho_proto::auth::Secret::from_text(b"master-test-cluster-secret-of-enough-length").unwrap());
    let cfg = MasterConfig {
        secret: Some(secret),
        default_kv_lease_ttl_ms: 40_000,
        put_start_discard_timeout_ms: 30_000,
        ..MasterConfig::default()
    };
    let e = Env::with(cfg);
    let m = &e.m;
    mount(m, A, 1, MIB);
    let key = |tenant: &str, key: &str| kref_in(tenant, key);
    let finish_in = |tenant: &str, k: &str| {
        let req = WriteFinish { client: A, tenant: tenant.into(), key: key(tenant, k), write_id: wid(A, k) };
        m.write_finish(&req, true).map(drop)
    };
    let w = put_start_as(m, "one", key("one", "a"), MIB).unwrap();
    finish_in("one", "a").unwrap();
    let r = m.get_replica_list(&KeyQuery { tenant: "one".into(), key: key("one", "a") }).unwrap().replicas[0].clone();
    assert!(r.cap.expires_ms > w[0].cap.expires_ms, "the read grant lasts longer");
    m.remove(&RemoveKey { tenant: "one".into(), key: key("one", "a"), force: true }).unwrap();
    // Tenant one reuses half of it for a value whose write grant is shorter, then drops it.
    let again = put_start_as(m, "one", key("one", "b"), MIB / 2).unwrap();
    assert_eq!(again[0].offset, w[0].offset);
    finish_in("one", "b").unwrap();
    m.remove(&RemoveKey { tenant: "one".into(), key: key("one", "b"), force: true }).unwrap();
    // Both halves stay held until the read grant's deadline has passed.
    e.advance(again[0].cap.expires_ms + HELD_PAST_EXPIRY_MS - e.clock.unix_now_ms() + 1);
    assert_eq!(put_start_as(m, "two", key("two", "c"), 4 * KIB), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    e.advance(r.cap.expires_ms + HELD_PAST_EXPIRY_MS - e.clock.unix_now_ms() - 1);
    assert_eq!(put_start_as(m, "two", key("two", "c"), 4 * KIB), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    e.advance(1);
    assert_eq!(put_start_as(m, "two", key("two", "c"), 4 * KIB).unwrap()[0].offset, w[0].offset);
}

/// After a takeover the master does not know which grants its predecessor minted: it treats
/// every range as granted for the longest a grant lasts from the takeover on.
#[test]
fn a_new_primary_holds_freed_ranges_for_any_grant_its_predecessor_may_have_minted() {
    let secret =
        Arc::new(tycho_proto::auth::Secret::from_text(b"master-test-cluster-secret-of-enough-length").unwrap());
    let e = Env::with(MasterConfig { secret: Some(secret), ..MasterConfig::default() });
    let m = &e.m;
    mount(m, A, 1, MIB);
    let epoch = std::cell::Cell::new(1);
    let at = |tenant: &str, key: &str| KeyRef { key: key.into(), route: route_for(tenant, key, epoch.get()) };
    let start_in = |tenant: &str, key: &str, size: u64| put_start_as(m, tenant, at(tenant, key), size);
    let first = start_in("one", "a", MIB).unwrap();
    let req = WriteFinish { client: A, tenant: "one".into(), key: kref_in("one", "a"), write_id: wid(A, "a") };
    m.write_finish(&req, true).unwrap();
    // Long after the write grant ran out, the group changes hands (here: to the same master).
    let written_until = first[0].cap.expires_ms + HELD_PAST_EXPIRY_MS;
    e.advance(written_until - e.clock.unix_now_ms() + 1000);
    assert!(m.stand_by(0));
    assert!(m.take_over(0, 2));
    epoch.set(2);
    let took_over = e.clock.unix_now_ms();
    m.remove(&RemoveKey { tenant: "one".into(), key: at("one", "a"), force: true }).unwrap();
    let cfg = m.config();
    let lifetime = cfg.put_start_discard_timeout_ms.max(2 * cfg.default_kv_lease_ttl_ms);
    e.advance(lifetime + HELD_PAST_EXPIRY_MS - 1);
    assert_eq!(start_in("two", "b", 4 * KIB), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    e.advance(1);
    assert_eq!(e.clock.unix_now_ms(), took_over + lifetime + HELD_PAST_EXPIRY_MS);
    assert_eq!(start_in("two", "b", 4 * KIB).unwrap()[0].offset, first[0].offset);
}

// ---- the apply path: a standby replays the primary's records -------------------------------

/// Keeps every record a primary applies, in order.
#[derive(Default)]
struct Recorder(parking_lot::Mutex<Vec<tycho_master::record::Record>>);

impl tycho_master::record::RecordSink for Recorder {
    fn append(&self, rec: tycho_master::record::Record) -> u64 {
        let mut log = self.0.lock();
        log.push(rec);
        log.len() as u64
    }

    fn durable(&self, _seq: u64) -> tycho_master::record::DurableFuture {
        Box::pin(async { Ok(()) })
    }

    fn appended(&self) -> u64 {
        self.0.lock().len() as u64
    }
}

/// Everything a replica list, a listing and the segment table say about a master's objects,
/// without leases (which are not logged) and capabilities.
/// Key, size, replicas, complete, soft-pinned, hard-pinned, and each replica's segment, offset,
/// length and generation.
type ObjectState = (String, u64, u32, bool, bool, bool, Vec<(SegmentId, u64, u64, u32)>);

fn state(m: &Master) -> (Vec<ObjectState>, Vec<(SegmentId, u64)>) {
    let mut objects: Vec<_> = m
        .list_keys(Some(T), None, u32::MAX)
        .unwrap()
        .into_iter()
        .map(|k| {
            let ranges = match get(m, &k.key) {
                Ok(l) => l.replicas.iter().map(|r| (r.segment, r.offset, r.len, r.gen)).collect(),
                Err(_) => Vec::new(),
            };
            (k.key, k.size, k.replicas, k.complete, k.soft_pinned, k.hard_pinned, ranges)
        })
        .collect();
    objects.sort();
    let mut segments: Vec<_> = m.list_segments().iter().map(|s| (s.desc.id, s.used)).collect();
    segments.sort();
    (objects, segments)
}

/// A workload on `primary` that makes every kind of record: puts (some with two replicas,
/// some soft-pinned), an upsert, a revoke, a pre-empted write, removals, a replica clear, an
/// abandoned write, an eviction, an unmount, and a write left pending.
fn busy_history(primary: &Env) {
    let m = &primary.m;
    mount(m, A, 1, 4 * MIB);
    mount(m, A, 2, 4 * MIB);
    mount(m, B, 3, 4 * MIB);
    let two = ReplicateConfig { replica_num: 2, ..Default::default() };
    for i in 0..20 {
        put_cfg(m, A, &format!("k{i}"), 1000 + i * 100, if i % 3 == 0 { two.clone() } else { soft(Some(90_000)) });
    }
    // Replaced, revoked, pinned, left pending (to be committed after the takeover).
    m.write_start(WriteMode::Upsert, &ws(A, "k1", 5000, ReplicateConfig { hard_pin: true, ..Default::default() }))
        .unwrap();
    m.write_finish(&wf(A, "k1"), true).unwrap();
    start(m, A, "revoked", 3000).unwrap();
    finish(m, A, "revoked", false).unwrap();
    // A stale write pre-empted by another writer's put.
    start(m, B, "stale", 2000).unwrap();
    primary.advance(DEFAULT_PUT_START_DISCARD_MS + 1);
    start(m, A, "stale", 2500).unwrap();
    finish(m, A, "stale", true).unwrap();
    remove(m, "k2", false).unwrap();
    let clear = ReplicaClear { client: A, tenant: T.into(), keys: vec![kref("k3")], segment: String::new() };
    assert_eq!(units(m.batch_replica_clear(&clear)), vec![Ok(())]);
    // An abandoned write, reclaimed by housekeeping after the release timeout.
    start(m, B, "abandoned", 1500).unwrap();
    primary.advance(DEFAULT_PUT_START_RELEASE_MS + 1);
    primary.tick_alive(&[A, B]);
    // Eviction, and a segment that goes away with its replicas.
    let (evicted, _) = m.evict();
    assert!(evicted > 0);
    m.unmount_segment(B, SegmentId(3)).unwrap();
    start(m, A, "pending", 7000).unwrap();
}

#[test]
fn a_standby_replaying_the_records_holds_the_same_metadata_and_can_take_over() {
    let primary = Env::new();
    let log = Arc::new(Recorder::default());
    assert!(primary.m.set_record_sink(0, Some(log.clone())));
    assert!(!primary.m.set_record_sink(1, Some(log.clone())), "a group the master does not hold has no sink");
    busy_history(&primary);
    let m = &primary.m;

    let records = log.0.lock().clone();
    let kinds: BTreeSet<&str> = records
        .iter()
        .map(|r| {
            use tycho_master::record::Record::*;
            match r {
                WriteStart { .. } => "start",
                WriteEnd { .. } => "end",
                WriteRevoke { .. } => "revoke",
                WriteDrop { .. } => "drop",
                Remove { evicted: false, .. } => "remove",
                Remove { evicted: true, .. } => "evict",
                DropReplicas { .. } => "drop-replicas",
                Mount { .. } => "mount",
                Unmount { .. } => "unmount",
                // (The task test replays these.)
                Task(_) => "task",
                CopyStart { .. } => "copy-start",
                CopyEnd { .. } => "copy-end",
                // (The fan-out tests replay these.)
                DynamicReplicas { .. } => "dynamic",
                Cooldown { .. } => "cooldown",
            }
        })
        .collect();
    let all = ["start", "end", "revoke", "drop", "remove", "evict", "drop-replicas", "mount", "unmount"];
    assert_eq!(kinds, all.into_iter().collect::<BTreeSet<_>>(), "the workload produces every kind of record");

    // The records survive their encoding, as the OpLog will store them.
    let batch = tycho_master::record::RecordBatch { group: 0, epoch: 1, first_seq: 1, records: records.clone() };
    let decoded = tycho_master::record::RecordBatch::decode(&batch.encode()).unwrap();

    let standby = Env::new();
    standby.advance(DEFAULT_PUT_START_DISCARD_MS + DEFAULT_PUT_START_RELEASE_MS + 2);
    for (i, r) in decoded.records.iter().enumerate() {
        standby.m.replay(0, r).unwrap_or_else(|e| panic!("record {i} ({r:?}) does not replay: {e}"));
    }
    let (objects, segments) = state(m);
    // (How many objects are left depends on where random placement put them: those only on
    // the unmounted segment went with it. About 13 of 20, rarely 10 or fewer.)
    assert!(objects.len() > 3 && objects.iter().any(|o| o.0 == "pending" && !o.3), "{objects:?}");
    assert!(segments.len() == 2 && segments.iter().all(|s| s.1 > 0), "{segments:?}");
    assert_eq!(state(&standby.m), (objects, segments), "the standby holds what the primary holds");

    // Replaying a record twice is a divergence, refused without changing anything.
    let before = state(&standby.m);
    let end = records.iter().find(|r| matches!(r, tycho_master::record::Record::WriteEnd { .. })).unwrap();
    assert!(standby.m.replay(0, end).is_err());
    assert_eq!(state(&standby.m), before);

    // The standby takes over: the write left pending on the primary commits there, and new
    // writes get ranges that do not collide with replayed ones.
    standby.m.write_finish(&wf(A, "pending"), true).unwrap();
    assert_eq!(get(&standby.m, "pending").unwrap().size, 7000);
    let fresh = put(&standby.m, A, "after-takeover", 4096);
    let taken: Vec<(SegmentId, u64, u32)> = state(&standby.m)
        .0
        .iter()
        .filter(|o| o.0 != "after-takeover")
        .flat_map(|o| o.6.iter().map(|r| (r.0, r.1, r.3)))
        .collect();
    for r in &fresh {
        assert!(!taken.iter().any(|t| t.0 == r.segment && t.1 == r.offset), "new range overlaps a replayed one");
        assert!(!taken.iter().any(|t| t.0 == r.segment && t.2 == r.gen), "generation reused");
    }
}

#[test]
fn a_snapshot_export_rebuilds_the_same_state_and_the_log_goes_on_from_it() {
    let primary = Env::new();
    let log = Arc::new(Recorder::default());
    assert!(primary.m.set_record_sink(0, Some(log.clone())));
    busy_history(&primary);
    let m = &primary.m;
    // A value written and removed: no live replica carries its generations, which must not be
    // handed out again.
    let both = ReplicateConfig { replica_num: 2, ..Default::default() };
    let gone: Vec<(SegmentId, u32)> =
        put_cfg(m, A, "gone", 4096, both.clone()).iter().map(|r| (r.segment, r.gen)).collect();
    assert_eq!(gone.len(), 2);
    remove(m, "gone", true).unwrap();
    // Copy and move tasks: one waiting, one running, one done.
    use tycho_master::task::{Task, TaskId, TaskKind, TaskRecord, TaskStatus};
    let task = |n: u128| Task {
        id: TaskId::new(0, n),
        kind: TaskKind::Copy,
        key: format!("k{n}").into_bytes(),
        source: "a".into(),
        targets: vec!["b".into()],
        assigned: A,
        status: TaskStatus::Pending,
        created_ms: 5,
        updated_ms: 5,
        message: String::new(),
    };
    for r in [
        TaskRecord::Created(task(1)),
        TaskRecord::Created(task(2)),
        TaskRecord::Created(task(3)),
        TaskRecord::Started { client: A, ids: vec![TaskId::new(0, 1), TaskId::new(0, 2)], at_ms: 6 },
        TaskRecord::Finished { id: TaskId::new(0, 2), status: TaskStatus::Success, message: "ok".into(), at_ms: 7 },
    ] {
        m.replay(0, &tycho_master::record::Record::Task(r)).unwrap();
    }
    let tasks = m.tasks(0).unwrap();
    assert_eq!(
        tasks.iter().map(|t| t.status).collect::<Vec<_>>(),
        [TaskStatus::Pending, TaskStatus::Processing, TaskStatus::Success]
    );
    let exported = m.export_group(0).unwrap();
    let at = log.0.lock().len();
    // Through the snapshot container, as a standby would read it.
    let dir = std::env::temp_dir().join(format!("tycho-export-{}-{}", std::process::id(), rand::random::<u64>()));
    let files = tycho_master::snapshot::DirSnapshotStore::new(&dir, "t");
    let id = tycho_master::snapshot::SnapshotId::new(0, at as u64, 1);
    tycho_master::snapshot::write(&files, id, exported.clone(), 512).unwrap();
    let imported = Env::new();
    imported.advance(primary.clock.now_ms() - imported.clock.now_ms());
    tycho_master::snapshot::read(&files, id, |e| {
        imported.m.import(0, e).unwrap_or_else(|err| panic!("{e:?} does not import: {err}"));
        Ok(())
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(state(&imported.m), state(m), "the import holds what the primary holds");
    assert_eq!(imported.m.tasks(0).unwrap(), tasks, "and the same tasks");
    assert_eq!(imported.m.export_group(0).unwrap(), exported, "and exports it alike");
    // A master serving from the import gives out generations after every one the primary
    // gave, live or not.
    let probe = Env::new();
    probe.advance(primary.clock.now_ms() - probe.clock.now_ms());
    exported.iter().for_each(|e| probe.m.import(0, e).unwrap());
    let fresh = put_cfg(&probe.m, A, "probe", 4096, both.clone());
    assert_eq!(fresh.len(), 2);
    for r in &fresh {
        let given = gone.iter().find(|g| g.0 == r.segment).unwrap().1;
        assert!(r.gen > given, "generation {} of {} handed out again (the primary gave {given})", r.gen, r.segment);
    }
    // Objects, segments with ranges held back, and a pending write all made it.
    use tycho_master::record::Record;
    use tycho_master::snapshot::Entry;
    let count = |f: &dyn Fn(&Entry) -> bool| exported.iter().filter(|e| f(e)).count();
    let complete = state(m).0.iter().filter(|o| o.3).count();
    assert!(complete > 3, "{complete} objects left by the workload");
    assert_eq!(count(&|e| matches!(e, Entry::Record(Record::WriteEnd { .. }))), complete);
    assert_eq!(count(&|e| matches!(e, Entry::Record(Record::Mount { .. }))), 2);
    assert_eq!(count(&|e| matches!(e, Entry::NextGen { .. })), 2);

    // The log after the snapshot applies to the import as it does to the primary.
    m.write_finish(&wf(A, "pending"), true).unwrap();
    put(m, A, "after", 4096);
    // (Eviction picked its victims at random: remove a key that is still there.)
    let victim = state(m).0.iter().find(|o| o.3 && o.0.starts_with('k')).map(|o| o.0.clone()).unwrap();
    remove(m, &victim, true).unwrap();
    m.write_start(WriteMode::Upsert, &ws(A, "k5", 6000, ReplicateConfig::default())).unwrap();
    m.write_finish(&wf(A, "k5"), true).unwrap();
    start(m, A, "again-pending", 2000).unwrap();
    let suffix: Vec<Record> = log.0.lock()[at..].to_vec();
    assert!(suffix.len() >= 6, "{suffix:?}");
    for r in &suffix {
        imported.m.replay(0, r).unwrap_or_else(|e| panic!("{r:?} does not replay on the import: {e}"));
    }
    assert_eq!(state(&imported.m), state(m));
    // Serving from the import allocates neither a taken range nor a used generation.
    let taken: Vec<(SegmentId, u64, u32)> =
        state(&imported.m).0.iter().flat_map(|o| o.6.iter().map(|r| (r.0, r.1, r.3))).collect();
    for r in &put(&imported.m, A, "fresh", 4096) {
        assert!(!taken.iter().any(|t| t.0 == r.segment && t.1 == r.offset), "new range overlaps an imported one");
        assert!(!taken.iter().any(|t| t.0 == r.segment && t.2 == r.gen), "generation reused");
    }
    // A reset forgets everything.
    imported.m.reset();
    assert!(imported.m.export_group(0).unwrap().is_empty());
    assert!(imported.m.tasks(0).unwrap().is_empty());
    assert_eq!(imported.m.group(0).unwrap().applied(), 0);
}

#[test]
fn with_several_groups_each_key_lives_in_its_group_container() {
    let e = Env::with(MasterConfig { group_count: 4, ..MasterConfig::default() });
    let m = &e.m;
    mount(m, A, 1, 64 * MIB);
    let names: Vec<String> = (0..200).map(|i| format!("g-{i}")).collect();
    for k in &names {
        put(m, A, k, 1000);
    }
    let per_group: Vec<u64> =
        (0..4).map(|rank| m.group(rank).unwrap().shards().iter().map(|s| s.read().len() as u64).sum()).collect();
    assert_eq!(per_group.iter().sum::<u64>(), 200);
    assert!(per_group.iter().all(|&n| n > 20), "keys spread over the four groups: {per_group:?}");
    assert!(m.group(4).is_none());
    for k in &names {
        let rank = tycho_routing::kvpt_to_rank(kref(k).route.partition_id, 4);
        assert_eq!(m.group(rank).unwrap().rank(), rank);
        assert_eq!(get(m, k).unwrap().size, 1000);
    }
    // A listing pages through every group in a stable order.
    let mut seen = BTreeSet::new();
    let mut after = None;
    loop {
        let (page, next) = m.list_keys_page(Some(T), 7, after);
        seen.extend(page.into_iter().map(|k| k.key));
        match next {
            Some(c) => after = Some(tycho_master::KeyCursor::parse(&c.to_string()).unwrap()),
            None => break,
        }
    }
    assert_eq!(seen, names.iter().cloned().collect::<BTreeSet<_>>());
    assert_eq!(objects(m), 200);
    // Eviction and removal visit every group.
    e.advance(LEASE + 1);
    assert!(m.evict().0 > 0);
    let before = objects(m);
    assert!(before < 200);
    assert_eq!(m.remove_all(true), before);
    assert_eq!(objects(m), 0);
}

// ---- copy and move tasks -------------------------------------------------------------------

fn create(m: &Master, key: &str, kind: TaskKind, source: &str, targets: &[&str]) -> WireResult<u128> {
    m.create_task(&CreateTask {
        tenant: T.into(),
        key: kref(key),
        kind,
        source: source.into(),
        targets: targets.iter().map(|t| t.to_string()).collect(),
    })
}

fn step(client: ClientId, key: &str, task: u128, write_id: u64) -> CopyStep {
    CopyStep { client, tenant: T.into(), key: kref(key), task, write_id, message: String::new() }
}

fn task_status(m: &Master, id: u128) -> WireResult<(TaskStatus, String)> {
    let route = RouteTag { partition_id: 0, epoch: 1 };
    m.query_task(&TaskQuery { tenant: T.into(), id, route }).map(|t| (t.status, t.message))
}

fn segments_of(m: &Master, key: &str) -> BTreeSet<u128> {
    get(m, key).map(|l| l.replicas.iter().map(|r| r.segment.0).collect()).unwrap_or_default()
}

#[test]
fn a_copy_task_adds_a_replica_a_move_moves_one_and_each_is_fenced() {
    let primary = Env::new();
    let log = Arc::new(Recorder::default());
    assert!(primary.m.set_record_sink(0, Some(log.clone())));
    let m = &primary.m;
    mount(m, A, 1, MIB);
    put(m, A, "k", 5000);
    put(m, A, "m", 3000);
    mount(m, B, 2, MIB);
    mount(m, C, 3, MIB);
    let seg1 = BTreeSet::from([1]);
    assert_eq!(segments_of(m, "k"), seg1);

    // Refused at once, with Mooncake's codes: no such key; no such target or source, a source
    // without a replica, a move to its own source or without exactly one target, no target.
    assert_eq!(create(m, "nope", TaskKind::Copy, "", &["seg-2"]), Err(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(create(m, "k", TaskKind::Copy, "", &["seg-9"]), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(create(m, "k", TaskKind::Move, "seg-2", &["seg-3"]), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(create(m, "k", TaskKind::Move, "seg-9", &["seg-3"]), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(create(m, "k", TaskKind::Move, "seg-1", &["seg-1"]), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(create(m, "k", TaskKind::Move, "seg-1", &["seg-2", "seg-3"]), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(create(m, "k", TaskKind::Copy, "", &[]), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(create(m, "k", TaskKind::Copy, "", &["seg-2", "seg-2"]), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(m.task_counts(), (0, 0, 0), "a refused task changes nothing");

    // A copy to two segments: assigned to A, which holds the replica; only A fetches it.
    let copy = create(m, "k", TaskKind::Copy, "", &["seg-2", "seg-3"]).unwrap();
    assert_eq!(task_status(m, copy), Ok((TaskStatus::Pending, String::new())));
    assert!(m.fetch_tasks(B).is_empty());
    let fetched = m.fetch_tasks(A);
    assert_eq!(fetched.len(), 1);
    let t = &fetched[0];
    assert_eq!((t.id, t.kind, t.key.as_str(), t.source.as_str()), (copy, TaskKind::Copy, "k", "seg-1"));
    assert_eq!((t.tenant.as_str(), t.assigned, t.status), (T, A, TaskStatus::Processing));
    assert!(m.fetch_tasks(A).is_empty(), "handed out once");
    // Only A runs it, on its own key.
    assert_eq!(m.copy_start(&step(B, "k", copy, 7)), Err(ErrorCode::ILLEGAL_CLIENT));
    assert_eq!(m.copy_start(&step(A, "m", copy, 7)), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(m.copy_start(&step(A, "k", copy + 1, 7)), Err(ErrorCode::TASK_NOT_FOUND));
    let before_copy = used(m);
    let grant = m.copy_start(&step(A, "k", copy, 7)).unwrap();
    assert_eq!(grant.source.segment, SegmentId(1));
    assert_eq!(grant.source.len, 5000);
    assert_eq!(grant.targets.iter().map(|r| r.segment.0).collect::<BTreeSet<_>>(), BTreeSet::from([2, 3]));
    assert!(used(m) > before_copy, "the targets' ranges are reserved");
    assert_eq!(m.copy_start(&step(A, "k", copy, 7)), Ok(grant.clone()), "a repeated start gets the same ranges");
    // While it copies: no remove but by force, no upsert, no other write's end; reads go on.
    assert_eq!(remove(m, "k", false), Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK));
    let upsert = m.write_start(WriteMode::Upsert, &ws(B, "k", 100, ReplicateConfig::default()));
    assert_eq!(upsert.err(), Some(ErrorCode::OBJECT_HAS_REPLICATION_TASK));
    assert_eq!(
        m.write_finish(&WriteFinish { client: A, tenant: T.into(), key: kref("k"), write_id: 7 }, true).err(),
        Some(ErrorCode::WRITE_DROPPED)
    );
    assert_eq!(segments_of(m, "k"), seg1, "the copies are not readable before the end");
    assert_eq!(
        m.copy_finish(&step(A, "k", copy, 8), true),
        Err(ErrorCode::OBJECT_NO_REPLICATION_TASK),
        "another copy id"
    );
    // (That failed the task: a copy step that names no pending copy ends it.)
    assert_eq!(task_status(m, copy).unwrap().0, TaskStatus::Failed);
    assert_eq!(
        m.copy_finish(&step(A, "k", copy, 7), true),
        Err(ErrorCode::OBJECT_NO_REPLICATION_TASK),
        "a failed task's copy does not commit"
    );
    assert_eq!(segments_of(m, "k"), seg1);
    assert!(used(m) > before_copy, "the dropped copy's ranges stay held: its client may still write");

    // Again, to the end: three readable replicas, the task done, a repeated end harmless.
    let copy = create(m, "k", TaskKind::Copy, "", &["seg-2", "seg-3"]).unwrap();
    assert_eq!(m.fetch_tasks(A).len(), 1);
    m.copy_start(&step(A, "k", copy, 9)).unwrap();
    m.copy_finish(&step(A, "k", copy, 9), true).unwrap();
    assert_eq!(segments_of(m, "k"), BTreeSet::from([1, 2, 3]));
    assert_eq!(task_status(m, copy), Ok((TaskStatus::Success, "done".into())));
    assert_eq!(m.copy_finish(&step(A, "k", copy, 9), true), Ok(()));
    // A copy to segments that hold the value already is done as it is created.
    let noop = create(m, "k", TaskKind::Copy, "", &["seg-1", "seg-2"]).unwrap();
    assert_eq!(task_status(m, noop).unwrap().0, TaskStatus::Success);
    assert!(m.fetch_tasks(A).is_empty());
    remove(m, "k", true).unwrap();

    // A move: the source replica goes only at the end.
    let mv = create(m, "m", TaskKind::Move, "seg-1", &["seg-2"]).unwrap();
    assert_eq!(m.fetch_tasks(A).len(), 1);
    m.copy_start(&step(A, "m", mv, 11)).unwrap();
    assert_eq!(segments_of(m, "m"), seg1);
    m.copy_finish(&step(A, "m", mv, 11), true).unwrap();
    assert_eq!(segments_of(m, "m"), BTreeSet::from([2]));
    assert_eq!(get(m, "m").unwrap().size, 3000);
    assert_eq!(used_of(m, 1), Some(0), "the source's range is free");
    // A move to a segment that holds a replica already drops the source's at once.
    let on_1 = ReplicateConfig { preferred_segments: vec!["seg-1".into()], ..Default::default() };
    put_cfg(m, A, "both", 1000, on_1);
    let copy_both = create(m, "both", TaskKind::Copy, "", &["seg-2"]).unwrap();
    assert_eq!(m.fetch_tasks(A).len(), 1);
    m.copy_start(&step(A, "both", copy_both, 10)).unwrap();
    m.copy_finish(&step(A, "both", copy_both, 10), true).unwrap();
    assert_eq!(segments_of(m, "both"), BTreeSet::from([1, 2]));
    let drop_move = create(m, "both", TaskKind::Move, "seg-1", &["seg-2"]).unwrap();
    assert_eq!(task_status(m, drop_move).unwrap().0, TaskStatus::Success);
    assert_eq!(segments_of(m, "both"), BTreeSet::from([2]));

    // A revoke frees the ranges at once and fails the task with the client's word.
    let back = create(m, "m", TaskKind::Move, "seg-2", &["seg-3"]).unwrap();
    assert_eq!(m.fetch_tasks(B).len(), 1);
    let before = used_of(m, 3);
    m.copy_start(&step(B, "m", back, 12)).unwrap();
    let mut revoke = step(B, "m", back, 12);
    revoke.message = "the network broke".into();
    m.copy_finish(&revoke, false).unwrap();
    assert_eq!(used_of(m, 3), before);
    assert_eq!(task_status(m, back), Ok((TaskStatus::Failed, "the network broke".into())));
    assert_eq!(segments_of(m, "m"), BTreeSet::from([2]));

    // A client that goes silent fails its tasks, and its pending copy is dropped.
    put(m, B, "n", 2000);
    let n_on = segments_of(m, "n");
    let source = format!("seg-{}", n_on.iter().next().unwrap());
    let target = ["seg-1", "seg-2", "seg-3"].into_iter().find(|s| **s != source).unwrap();
    let orphan = create(m, "n", TaskKind::Copy, "", &[target]).unwrap();
    let owner = m.fetch_tasks(A).into_iter().chain(m.fetch_tasks(B)).chain(m.fetch_tasks(C)).next().unwrap().assigned;
    m.copy_start(&step(owner, "n", orphan, 13)).unwrap();
    let others: Vec<ClientId> = [A, B, C].into_iter().filter(|c| *c != owner).collect();
    for _ in 0..(DEFAULT_CLIENT_TTL_MS / 1000 + 2) {
        primary.advance(1000);
        primary.tick_alive(&others);
    }
    assert_eq!(task_status(m, orphan).unwrap().0, TaskStatus::Failed);
    assert_eq!(m.copy_finish(&step(owner, "n", orphan, 13), true).err(), Some(ErrorCode::OBJECT_NO_REPLICATION_TASK));

    // Every record replays on a standby to the same objects, segments and tasks.
    let records = log.0.lock().clone();
    use tycho_master::record::Record;
    assert!(records.iter().any(|r| matches!(r, Record::CopyStart { .. })));
    assert!(records.iter().any(|r| matches!(r, Record::CopyEnd { .. })));
    let batch = tycho_master::record::RecordBatch { group: 0, epoch: 1, first_seq: 1, records };
    let standby = Env::new();
    standby.advance(primary.clock.now_ms() - standby.clock.now_ms());
    for r in tycho_master::record::RecordBatch::decode(&batch.encode()).unwrap().records {
        standby.m.replay(0, &r).unwrap_or_else(|e| panic!("{r:?} does not replay: {e}"));
    }
    assert_eq!(state(&standby.m), state(m));
    assert_eq!(standby.m.tasks(0), m.tasks(0));
}

#[test]
fn a_pending_copy_survives_a_snapshot_and_task_limits_hold() {
    let cfg = MasterConfig {
        task_limits: tycho_master::task::TaskLimits { max_pending: 2, max_finished: 1, ..Default::default() },
        ..MasterConfig::default()
    };
    let primary = Env::with(cfg.clone());
    let log = Arc::new(Recorder::default());
    assert!(primary.m.set_record_sink(0, Some(log.clone())));
    let m = &primary.m;
    mount(m, A, 1, MIB);
    for k in ["a", "b", "c"] {
        put(m, A, k, 1000);
    }
    mount(m, B, 2, MIB);
    let first = create(m, "a", TaskKind::Copy, "", &["seg-2"]).unwrap();
    let second = create(m, "b", TaskKind::Copy, "", &["seg-2"]).unwrap();
    assert_eq!(create(m, "c", TaskKind::Copy, "", &["seg-2"]), Err(ErrorCode::TASK_PENDING_LIMIT_EXCEEDED));
    assert_eq!(m.fetch_tasks(A).len(), 2);
    m.copy_start(&step(A, "a", first, 1)).unwrap();
    // The export of a running copy, imported, ends as on the primary.
    let exported = m.export_group(0).unwrap();
    let at = log.0.lock().len();
    m.copy_finish(&step(A, "a", first, 1), true).unwrap();
    let imported = Env::with(cfg);
    imported.advance(primary.clock.now_ms() - imported.clock.now_ms());
    exported.iter().for_each(|e| imported.m.import(0, e).unwrap());
    assert_eq!(imported.m.export_group(0).unwrap(), exported, "the running copy comes back as it was");
    for r in log.0.lock()[at..].iter() {
        imported.m.replay(0, r).unwrap_or_else(|e| panic!("{r:?} does not replay on the import: {e}"));
    }
    assert_eq!(state(&imported.m), state(m));
    assert_eq!(segments_of(&imported.m, "a"), BTreeSet::from([1, 2]));
    // The finished limit: one kept, the older forgotten (TASK_NOT_FOUND) at the next look.
    m.copy_start(&step(A, "b", second, 2)).unwrap();
    m.copy_finish(&step(A, "b", second, 2), true).unwrap();
    primary.advance(2000);
    primary.tick_alive(&[A, B]);
    assert_eq!(task_status(m, first).err(), Some(ErrorCode::TASK_NOT_FOUND));
    assert_eq!(task_status(m, second).unwrap().0, TaskStatus::Success);
    // A task that runs past its timeout fails, and its copy goes with it (the object is no
    // longer held, the copy cannot commit).
    let slow = create(m, "c", TaskKind::Copy, "", &["seg-2"]).unwrap();
    assert_eq!(m.fetch_tasks(A).len(), 1);
    m.copy_start(&step(A, "c", slow, 3)).unwrap();
    assert_eq!(remove(m, "c", false), Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK));
    primary.advance(tycho_master::task::TaskLimits::default().processing_timeout_ms + 2000);
    primary.tick_alive(&[A, B]);
    assert_eq!(task_status(m, slow), Ok((TaskStatus::Failed, "processing timeout".into())));
    assert_eq!(m.copy_finish(&step(A, "c", slow, 3), true), Err(ErrorCode::OBJECT_NO_REPLICATION_TASK));
    assert_eq!(segments_of(m, "c"), BTreeSet::from([1]));
    remove(m, "c", true).unwrap();
    // Another tenant's query finds nothing.
    let route = RouteTag { partition_id: 0, epoch: 1 };
    let other = m.query_task(&TaskQuery { tenant: "tenant-b".into(), id: slow, route });
    assert_eq!(other.err(), Some(ErrorCode::TASK_NOT_FOUND));
}

// ---- hot-replica fan-out -------------------------------------------------------------------

fn fanout_env(mode: tycho_master::FanoutMode) -> Env {
    let fanout = tycho_master::FanoutConfig { mode, ..Default::default() };
    Env::with(MasterConfig { fanout, ..MasterConfig::default() })
}

/// Mounts segment `id` for `client` on host `host`.
fn mount_on(m: &Master, client: ClientId, id: u128, host: &str) {
    let d = SegmentDesc { host: host.into(), ..seg_desc(id, MIB) };
    m.mount_segment(client, d).unwrap();
}

fn suppressed(m: &Master, why: tycho_master::Suppressed) -> u64 {
    let i = tycho_master::Suppressed::ALL.iter().position(|s| *s == why).unwrap();
    m.fanout.suppressed[i].load(Ordering::Relaxed)
}

#[test]
fn a_key_read_past_the_threshold_gets_a_copy_on_another_host_in_enforce_mode() {
    use tycho_master::{FanoutMode, Suppressed};
    let e = fanout_env(FanoutMode::Enforce);
    let m = &e.m;
    mount_on(m, A, 1, "host-a");
    put(m, A, "hot", 4096);
    put(m, A, "batch-hot", 4096);
    // Another segment of the source's host, with the lowest id: passed over for another host's.
    mount_on(m, A, 2, "host-a");
    mount_on(m, B, 7, "host-b");
    mount_on(m, C, 5, "host-c");
    // Seven reads in the window (10 s at 0.8/s: eight make a key hot): nothing.
    for _ in 0..7 {
        get(m, "hot").unwrap();
    }
    e.tick_alive(&[A, B, C]);
    assert_eq!(m.fanout.hot.load(Ordering::Relaxed), 0);
    assert!(m.fetch_tasks(A).is_empty(), "below the threshold nothing is admitted");
    get(m, "hot").unwrap();
    // BatchGet counts too.
    let batch = BatchKeyQuery { tenant: T.into(), keys: vec![kref("batch-hot")] };
    for _ in 0..8 {
        assert!(m.batch_get_replica_list(&batch)[0].is_ok());
    }
    e.tick_alive(&[A, B, C]);
    assert_eq!(m.fanout.hot.load(Ordering::Relaxed), 2);
    assert_eq!(m.fanout.admitted.load(Ordering::Relaxed), 2);
    let tasks = m.fetch_tasks(A);
    assert_eq!(tasks.len(), 2, "{tasks:?}");
    for t in &tasks {
        assert_eq!((t.kind, t.source.as_str()), (TaskKind::Copy, "seg-1"));
        assert_eq!(t.targets, vec!["seg-5".to_string()], "another host first, then the lowest id");
        m.copy_start(&step(A, &t.key, t.id, 40)).unwrap();
        m.copy_finish(&step(A, &t.key, t.id, 40), true).unwrap();
    }
    assert_eq!(segments_of(m, "hot"), BTreeSet::from([1, 5]));
    // Hot again in the next window: two replicas is the limit.
    e.advance(10_000);
    for _ in 0..8 {
        get(m, "hot").unwrap();
    }
    e.tick_alive(&[A, B, C]);
    assert_eq!(suppressed(m, Suppressed::ReplicaLimit), 1);
    assert!(m.fetch_tasks(A).is_empty() && m.fetch_tasks(C).is_empty());
    // A hot key with a task waiting already is in flight.
    let two = ReplicateConfig { preferred_segments: vec!["seg-1".into()], ..Default::default() };
    put_cfg(m, A, "busy", 4096, two);
    create(m, "busy", TaskKind::Copy, "", &["seg-7"]).unwrap();
    for _ in 0..8 {
        get(m, "busy").unwrap();
    }
    e.tick_alive(&[A, B, C]);
    assert_eq!(suppressed(m, Suppressed::InFlight), 1);
}

#[test]
fn observe_mode_counts_what_it_would_do_and_creates_nothing() {
    use tycho_master::FanoutMode;
    let e = fanout_env(FanoutMode::Observe);
    let m = &e.m;
    mount_on(m, A, 1, "host-a");
    put(m, A, "hot", 4096);
    mount_on(m, B, 2, "host-b");
    for _ in 0..8 {
        get(m, "hot").unwrap();
    }
    e.tick_alive(&[A, B]);
    assert_eq!(m.fanout.hot.load(Ordering::Relaxed), 1);
    assert_eq!(m.fanout.admitted.load(Ordering::Relaxed), 1);
    assert!(m.fetch_tasks(A).is_empty(), "observe mode creates no task");
    assert_eq!(m.task_counts(), (0, 0, 0));
    assert_eq!(segments_of(m, "hot"), BTreeSet::from([1]));
    // And with fan-out off, no heat is kept at all.
    let off = fanout_env(FanoutMode::Off);
    mount_on(&off.m, A, 1, "host-a");
    put(&off.m, A, "hot", 4096);
    for _ in 0..20 {
        get(&off.m, "hot").unwrap();
    }
    off.tick_alive(&[A]);
    assert_eq!((off.m.fanout.hot.load(Ordering::Relaxed), off.m.heat_keys()), (0, 0));
}

/// Puts `key` on seg-1 (A's, on host a).
fn put_a(m: &Master, key: &str, size: u64) {
    put_cfg(m, A, key, size, ReplicateConfig { preferred_segments: vec!["seg-1".into()], ..Default::default() });
}

/// Reads `key` eight times (10 s at 0.8/s: hot) and runs housekeeping, which admits it.
fn make_hot(e: &Env, key: &str, alive: &[ClientId]) {
    for _ in 0..8 {
        get(&e.m, key).unwrap();
    }
    e.tick_alive(alive);
}

/// The copy task fan-out created for `client`, fetched (it runs from now on).
fn dynamic_task(m: &Master, client: ClientId) -> TaskInfo {
    let mut tasks = m.fetch_tasks(client);
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    tasks.pop().unwrap()
}

/// Fan-out on hosts a (seg-1, the value's) and b (seg-5, the target), in enforce mode, its
/// records kept.
fn dynamic_env() -> (Env, Arc<Recorder>) {
    let e = fanout_env(tycho_master::FanoutMode::Enforce);
    let log = Arc::new(Recorder::default());
    assert!(e.m.set_record_sink(0, Some(log.clone())));
    mount_on(&e.m, A, 1, "host-a");
    mount_on(&e.m, B, 5, "host-b");
    (e, log)
}

#[test]
fn a_dynamic_copy_runs_under_its_lease_and_its_replica_is_marked_dynamic() {
    let (e, log) = dynamic_env();
    let m = &e.m;
    put_a(m, "hot", 4096);
    make_hot(&e, "hot", &[A, B]);
    assert_eq!(m.dynamic_leases(), 1, "the lease comes with the task");
    let t = dynamic_task(m, A);
    // Only the source's client may run it; another's step changes nothing.
    assert_eq!(m.copy_start(&step(B, "hot", t.id, 9)).err(), Some(ErrorCode::ILLEGAL_CLIENT));
    m.copy_start(&step(A, "hot", t.id, 9)).unwrap();
    assert_eq!(m.copy_finish(&step(B, "hot", t.id, 9), true), Err(ErrorCode::ILLEGAL_CLIENT));
    assert_eq!(m.copy_finish(&step(B, "hot", t.id, 9), false), Err(ErrorCode::ILLEGAL_CLIENT));
    assert_eq!(task_status(m, t.id).unwrap().0, TaskStatus::Processing);
    m.copy_finish(&step(A, "hot", t.id, 9), true).unwrap();
    // The copy's replica is complete, readable and dynamic; the lease ended with the task.
    assert_eq!(segments_of(m, "hot"), BTreeSet::from([1, 5]));
    assert_eq!(get(m, "hot").unwrap().replicas.len(), 2);
    assert_eq!((m.dynamic_replicas(), m.dynamic_leases()), (1, 0));
    assert_eq!(task_status(m, t.id).unwrap(), (TaskStatus::Success, "done".into()));
    // A standby replaying the log, and a master importing a snapshot, know it is dynamic.
    let standby = fanout_env(tycho_master::FanoutMode::Enforce);
    standby.advance(e.clock.now_ms() - standby.clock.now_ms());
    for r in log.0.lock().iter() {
        standby.m.replay(0, r).unwrap_or_else(|err| panic!("{r:?} does not replay: {err}"));
    }
    assert_eq!(state(&standby.m), state(m));
    assert_eq!(standby.m.dynamic_replicas(), 1);
    let exported = m.export_group(0).unwrap();
    let imported = fanout_env(tycho_master::FanoutMode::Enforce);
    imported.advance(e.clock.now_ms() - imported.clock.now_ms());
    exported.iter().for_each(|x| imported.m.import(0, x).unwrap());
    assert_eq!(imported.m.export_group(0).unwrap(), exported);
    assert_eq!(imported.m.dynamic_replicas(), 1);
    // The replica goes with its value: an upsert's new value has none.
    m.write_start(WriteMode::Upsert, &ws(B, "hot", 4096, ReplicateConfig::default())).unwrap();
    m.write_finish(&wf(B, "hot"), true).unwrap();
    assert_eq!(m.dynamic_replicas(), 0);
}

#[test]
fn a_dynamic_copy_whose_lease_expired_or_whose_value_changed_is_refused_and_cleaned_up() {
    let (e, _log) = dynamic_env();
    let m = &e.m;
    let lease_ms = tycho_master::FanoutConfig::default().lease_ms;
    for k in ["late-start", "late-end", "late-revoke", "changed"] {
        put_a(m, k, 4096);
    }
    // Expired before its CopyStart: refused, the task fails, nothing is pending.
    make_hot(&e, "late-start", &[A, B]);
    let t = dynamic_task(m, A);
    e.advance(lease_ms);
    assert_eq!(m.copy_start(&step(A, "late-start", t.id, 1)).err(), Some(ErrorCode::LEASE_EXPIRED));
    assert_eq!(
        task_status(m, t.id).unwrap(),
        (TaskStatus::Failed, "its dynamic copy lease expired (LEASE_EXPIRED)".into())
    );
    assert_eq!(m.dynamic_leases(), 0);
    // Expired between CopyStart and CopyEnd, or CopyRevoke: refused, the copy is dropped.
    e.advance(10_000);
    for (key, end) in [("late-end", true), ("late-revoke", false)] {
        make_hot(&e, key, &[A, B]);
        let t = dynamic_task(m, A);
        m.copy_start(&step(A, key, t.id, 2)).unwrap();
        e.advance(lease_ms);
        assert_eq!(m.copy_finish(&step(A, key, t.id, 2), end), Err(ErrorCode::LEASE_EXPIRED), "{key}");
        assert_eq!(task_status(m, t.id).unwrap().0, TaskStatus::Failed);
        assert_eq!(segments_of(m, key), BTreeSet::from([1]));
        // Nothing pending: an ordinary copy of the key runs.
        let plain = create(m, key, TaskKind::Copy, "", &["seg-5"]).unwrap();
        assert_eq!(m.fetch_tasks(A).len(), 1);
        m.copy_start(&step(A, key, plain, 3)).unwrap();
        m.copy_finish(&step(A, key, plain, 3), true).unwrap();
        assert_eq!(segments_of(m, key), BTreeSet::from([1, 5]));
    }
    assert_eq!(m.dynamic_replicas(), 0, "ordinary copies are not dynamic");
    // The value changed after the lease was granted (an upsert while the task waited).
    e.advance(10_000);
    make_hot(&e, "changed", &[A, B]);
    let on_seg1 = ReplicateConfig { preferred_segments: vec!["seg-1".into()], ..Default::default() };
    m.write_start(WriteMode::Upsert, &ws(B, "changed", 4096, on_seg1)).unwrap();
    m.write_finish(&wf(B, "changed"), true).unwrap();
    let t = dynamic_task(m, A);
    assert_eq!(m.copy_start(&step(A, "changed", t.id, 4)).err(), Some(ErrorCode::INVALID_VERSION));
    assert_eq!(task_status(m, t.id).unwrap().0, TaskStatus::Failed);
    assert_eq!(m.dynamic_leases(), 0);
    // A copy pending under a lease of another version (no start makes one: forged here by
    // applying a record by hand) is refused at its end and its revoke alike, and dropped.
    for end in [true, false] {
        e.advance(10_000);
        make_hot(&e, "changed", &[A, B]);
        let t = dynamic_task(m, A);
        let forged = tycho_master::record::Record::CopyStart {
            key: tycho_routing::encode_object_key(T, "changed"),
            writer: A,
            write_id: 5,
            started_ms: e.clock.unix_now_ms(),
            task: tycho_master::task::TaskId(t.id),
            version: 12345,
            source: None,
            replicas: Vec::new(),
        };
        m.replay(0, &forged).unwrap();
        assert_eq!(m.copy_finish(&step(A, "changed", t.id, 5), end), Err(ErrorCode::INVALID_VERSION));
        assert_eq!(task_status(m, t.id).unwrap().0, TaskStatus::Failed);
        e.advance(LEASE + DEFAULT_PUT_START_RELEASE_MS);
        e.tick_alive(&[A, B]);
        assert_eq!(remove(m, "changed", false), Ok(()), "nothing pending is left");
        put_a(m, "changed", 4096);
    }
}

#[test]
fn the_reaper_ends_expired_dynamic_copies_without_touching_newer_ones_or_ordinary_copies() {
    let (e, _log) = dynamic_env();
    let m = &e.m;
    let lease_ms = tycho_master::FanoutConfig::default().lease_ms;
    put_a(m, "hot", 4096);
    make_hot(&e, "hot", &[A, B]);
    let stale = dynamic_task(m, A);
    m.copy_start(&step(A, "hot", stale.id, 1)).unwrap();
    assert_eq!(remove(m, "hot", false), Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK));
    // Its lease runs out: the reaper fails the task and drops its copy.
    e.advance(lease_ms + 1000);
    e.tick_alive(&[A, B]);
    assert_eq!(task_status(m, stale.id).unwrap(), (TaskStatus::Failed, "its dynamic copy lease expired".into()));
    assert_eq!(m.dynamic_leases(), 0);
    // An ordinary copy of the key is not blocked by it.
    mount_on(m, C, 7, "host-c");
    let plain = create(m, "hot", TaskKind::Copy, "", &["seg-7"]).unwrap();
    assert_eq!(m.fetch_tasks(A).len(), 1);
    m.copy_start(&step(A, "hot", plain, 2)).unwrap();
    // The stale task's late steps change nothing of the running copy.
    assert_eq!(m.copy_start(&step(A, "hot", stale.id, 1)).err(), Some(ErrorCode::OBJECT_NO_REPLICATION_TASK));
    assert_eq!(m.copy_finish(&step(A, "hot", stale.id, 1), true), Err(ErrorCode::OBJECT_NO_REPLICATION_TASK));
    assert_eq!(m.copy_finish(&step(A, "hot", stale.id, 1), false), Ok(()), "a repeated revoke of a failed task");
    m.copy_finish(&step(A, "hot", plain, 2), true).unwrap();
    assert_eq!(segments_of(m, "hot"), BTreeSet::from([1, 7]));
    // Hot again with a newer lease: the stale task's steps do not disturb its copy either.
    remove(m, "hot", true).unwrap();
    put_a(m, "hot", 4096);
    e.advance(10_000);
    make_hot(&e, "hot", &[A, B, C]);
    let newer = dynamic_task(m, A);
    m.copy_start(&step(A, "hot", newer.id, 3)).unwrap();
    assert_eq!(m.copy_finish(&step(A, "hot", stale.id, 1), true), Err(ErrorCode::OBJECT_NO_REPLICATION_TASK));
    m.copy_finish(&step(A, "hot", newer.id, 3), true).unwrap();
    assert_eq!(m.dynamic_replicas(), 1);
}

#[test]
fn a_failed_dynamic_copy_leaves_nothing_pending() {
    let (e, _log) = dynamic_env();
    let m = &e.m;
    // No room on the target at CopyStart (it filled after admission): the start fails and
    // clears its lease and pending state.
    put_a(m, "big", 600 * KIB);
    make_hot(&e, "big", &[A, B]);
    let t = dynamic_task(m, A);
    put(m, B, "filler", 600 * KIB);
    assert_eq!(m.copy_start(&step(A, "big", t.id, 1)).err(), Some(ErrorCode::NO_AVAILABLE_HANDLE));
    assert_eq!(task_status(m, t.id).unwrap().0, TaskStatus::Failed);
    assert_eq!(m.dynamic_leases(), 0);
    e.advance(LEASE + 1);
    assert_eq!(remove(m, "big", false), Ok(()), "nothing holds the object");
    // The target went away during the copy: its CopyEnd fails and no incomplete replica stays.
    put_a(m, "hot", 4096);
    e.advance(10_000);
    make_hot(&e, "hot", &[A, B]);
    let t = dynamic_task(m, A);
    m.copy_start(&step(A, "hot", t.id, 2)).unwrap();
    let filler_gone = remove(m, "filler", true);
    assert_eq!(filler_gone, Ok(()));
    // (The unmount's sweep drops the copy's range on it, and with it the copy.)
    m.unmount_segment(B, SegmentId(5)).unwrap();
    assert_eq!(m.copy_finish(&step(A, "hot", t.id, 2), true), Err(ErrorCode::OBJECT_NO_REPLICATION_TASK));
    assert_eq!(task_status(m, t.id).unwrap().0, TaskStatus::Failed);
    assert_eq!(segments_of(m, "hot"), BTreeSet::from([1]));
    assert_eq!((m.dynamic_replicas(), m.dynamic_leases()), (0, 0));
    e.advance(LEASE + 1);
    assert_eq!(remove(m, "hot", false), Ok(()), "nothing holds the object");
    // A copy whose source replica went before its start fails at once (and the failure,
    // which takes the key's lock, does not wait on the check's own lock).
    mount_on(m, C, 7, "host-c");
    put_a(m, "moved", 4096);
    let plain = create(m, "moved", TaskKind::Copy, "seg-1", &["seg-7"]).unwrap();
    assert_eq!(m.fetch_tasks(A).len(), 1);
    let elsewhere = ReplicateConfig { preferred_segments: vec!["seg-7".into()], ..Default::default() };
    m.write_start(WriteMode::Upsert, &ws(C, "moved", 4096, elsewhere)).unwrap();
    m.write_finish(&wf(C, "moved"), true).unwrap();
    assert_eq!(m.copy_start(&step(A, "moved", plain, 3)).err(), Some(ErrorCode::REPLICA_NOT_FOUND));
    assert_eq!(task_status(m, plain).unwrap().0, TaskStatus::Failed);
}

#[test]
fn eviction_drops_dynamic_replicas_first_and_fanout_waits_out_the_cooldown() {
    use tycho_master::Suppressed;
    let (e, log) = dynamic_env();
    let m = &e.m;
    put_a(m, "hot", 4096);
    put_a(m, "cold", 4096);
    make_hot(&e, "hot", &[A, B]);
    let t = dynamic_task(m, A);
    m.copy_start(&step(A, "hot", t.id, 1)).unwrap();
    m.copy_finish(&step(A, "hot", t.id, 1), true).unwrap();
    assert_eq!(m.dynamic_replicas(), 1);
    // A round that takes one victim takes the dynamic replica, not an object.
    e.advance(LEASE + 1);
    assert_eq!(m.evict(), (0, 4096), "one victim (5% of two candidates, rounded up)");
    assert_eq!(segments_of(m, "hot"), BTreeSet::from([1]));
    assert!(exists(m, "cold").unwrap());
    assert_eq!((m.dynamic_replicas(), m.fanout.shrunk.load(Ordering::Relaxed)), (0, 1));
    // Hot again at once: the cooldown holds fan-out back, and a standby knows it.
    e.advance(10_000);
    make_hot(&e, "hot", &[A, B]);
    assert_eq!(suppressed(m, Suppressed::Cooldown), 1);
    assert!(m.fetch_tasks(A).is_empty());
    let standby = fanout_env(tycho_master::FanoutMode::Enforce);
    standby.advance(e.clock.now_ms() - standby.clock.now_ms());
    for r in log.0.lock().iter() {
        standby.m.replay(0, r).unwrap_or_else(|err| panic!("{r:?} does not replay: {err}"));
    }
    assert_eq!(standby.m.export_group(0).unwrap(), m.export_group(0).unwrap());
    // Past the cooldown it gets its copy again.
    e.advance(tycho_master::FanoutConfig::default().cooldown_ms);
    make_hot(&e, "hot", &[A, B]);
    assert_eq!(dynamic_task(m, A).targets, vec!["seg-5".to_string()]);
}

#[test]
fn suppression_reasons_index_their_counters() {
    for (i, why) in tycho_master::Suppressed::ALL.iter().enumerate() {
        assert_eq!(why.index(), i, "{why:?}");
    }
}

#[test]
fn the_source_is_the_lowest_named_replica_and_the_target_prefers_another_host_then_room() {
    let fanout = tycho_master::FanoutConfig {
        mode: tycho_master::FanoutMode::Enforce,
        max_memory_replicas: 3,
        ..Default::default()
    };
    let e = Env::with(MasterConfig { fanout, ..MasterConfig::default() });
    let m = &e.m;
    mount_on(m, A, 3, "host-a");
    mount_on(m, A, 2, "host-a");
    let both = ReplicateConfig {
        replica_num: 2,
        preferred_segments: vec!["seg-3".into(), "seg-2".into()],
        ..Default::default()
    };
    put_cfg(m, A, "hot", 4096, both);
    // A segment of the value's host (lowest id), a nearly full one of another host, and an
    // empty one of that host.
    mount_on(m, A, 4, "host-a");
    mount_on(m, B, 6, "host-b");
    mount_on(m, B, 9, "host-b");
    put_cfg(
        m,
        B,
        "filler",
        900 * KIB,
        ReplicateConfig { preferred_segments: vec!["seg-6".into()], ..Default::default() },
    );
    make_hot(&e, "hot", &[A, B]);
    let t = dynamic_task(m, A);
    assert_eq!(t.source, "seg-2", "the lowest name, whatever the replicas' order");
    assert_eq!(t.targets, vec!["seg-9".to_string()], "another host, then one that stays below 85% full");
}

#[test]
fn an_expired_dynamic_copy_gives_way_at_once_and_is_not_started_again() {
    let (e, _log) = dynamic_env();
    let m = &e.m;
    let lease_ms = tycho_master::FanoutConfig::default().lease_ms;
    put_a(m, "hot", 4096);
    put_a(m, "again", 4096);
    make_hot(&e, "hot", &[A, B]);
    let dynamic = dynamic_task(m, A);
    m.copy_start(&step(A, "hot", dynamic.id, 1)).unwrap();
    mount_on(m, C, 7, "host-c");
    let plain = create(m, "hot", TaskKind::Copy, "", &["seg-7"]).unwrap();
    assert_eq!(m.fetch_tasks(A).len(), 1);
    // The lease runs out and no housekeeping runs: the ordinary copy's start ends the expired
    // copy itself instead of failing on it.
    e.advance(lease_ms);
    m.copy_start(&step(A, "hot", plain, 2)).unwrap();
    assert_eq!(task_status(m, dynamic.id).unwrap(), (TaskStatus::Failed, "its dynamic copy lease expired".into()));
    m.copy_finish(&step(A, "hot", plain, 2), true).unwrap();
    assert_eq!(segments_of(m, "hot"), BTreeSet::from([1, 7]));
    // A repeated start of a copy whose lease ran out is refused, not granted its ranges again.
    make_hot(&e, "again", &[A, B, C]);
    let t = dynamic_task(m, A);
    m.copy_start(&step(A, "again", t.id, 3)).unwrap();
    e.advance(lease_ms);
    assert_eq!(m.copy_start(&step(A, "again", t.id, 3)).err(), Some(ErrorCode::LEASE_EXPIRED));
    assert_eq!(task_status(m, t.id).unwrap().0, TaskStatus::Failed);
    assert_eq!(m.dynamic_leases(), 0);
}

/// A log whose durable prefix the test moves by hand.
#[derive(Default)]
struct HeldLog {
    records: parking_lot::Mutex<Vec<tycho_master::record::Record>>,
    durable: std::sync::atomic::AtomicU64,
}

impl tycho_master::record::RecordSink for HeldLog {
    fn append(&self, rec: tycho_master::record::Record) -> u64 {
        let mut log = self.records.lock();
        log.push(rec);
        log.len() as u64
    }

    fn durable(&self, _seq: u64) -> tycho_master::record::DurableFuture {
        Box::pin(async { Ok(()) })
    }

    fn appended(&self) -> u64 {
        self.records.lock().len() as u64
    }

    fn committed(&self) -> u64 {
        self.durable.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The read gate: a lookup of a key whose shard has a record in flight waits for that record
/// (the RPC layer waits for what the thread noted), whether the record made a value visible
/// or removed one; once the log caught up, or for a shard with nothing in flight, it waits for
/// nothing.
#[test]
fn reads_wait_for_the_records_that_changed_what_they_see() {
    use std::sync::atomic::Ordering::Release;
    let env = Env::new();
    let m = &env.m;
    mount(m, A, 1, 4 * MIB);
    let log = Arc::new(HeldLog::default());
    assert!(m.set_record_sink(0, Some(log.clone())));
    Master::take_logged();
    put(m, A, "seen", 4096);
    // (The writer's own answer waits for its records.)
    let written = Master::take_logged().last();
    assert!(written > 0);
    // Not durable yet: the read notes the write's last record.
    assert!(get(m, "seen").is_ok());
    assert_eq!(Master::take_logged().last(), written, "a read of a value not yet durable waits for it");
    assert_eq!(exists(m, "seen"), Ok(true));
    assert_eq!(Master::take_logged().last(), written);
    let batch = BatchKeyQuery { tenant: T.into(), keys: vec![kref("seen")] };
    assert!(m.batch_get_replica_list(&batch)[0].is_ok());
    assert_eq!(Master::take_logged().last(), written);
    // Durable: nothing to wait for.
    log.durable.store(written, Release);
    assert!(get(m, "seen").is_ok());
    assert!(Master::take_logged().is_empty(), "a read of durable state waits for nothing");
    // A removal not yet durable: a read that misses the key waits for it too.
    remove(m, "seen", true).unwrap();
    let removed = Master::take_logged().last();
    assert!(removed > written);
    assert_eq!(exists(m, "seen"), Ok(false));
    assert_eq!(Master::take_logged().last(), removed, "a miss caused by a removal not yet durable waits for it");
    // A key of a shard with nothing in flight waits for nothing (the shard of "seen" is some
    // other one for one of these keys).
    let idle = (0..64).map(|i| format!("other{i}")).find(|k| {
        let _ = get(m, k);
        Master::take_logged().is_empty()
    });
    assert!(idle.is_some(), "every key's shard had a record in flight");
    log.durable.store(removed, Release);
    assert_eq!(exists(m, "seen"), Ok(false));
    assert!(Master::take_logged().is_empty());
}

/// Issue 48: a stable segment's descriptor is what its owner mounted, under a name whose id it
/// is; a forged name, another client's segment, or one not mounted are refused.
#[test]
fn a_stable_segments_descriptor_comes_from_its_mount() {
    use tycho_proto::quota::{stable_segment_id, Medium};
    let e = Env::new();
    let m = &e.m;
    let id = stable_segment_id("node-7");
    let d = SegmentDesc { id, ..seg_desc(7, 4 * MIB) };
    m.mount_segment(A, d.clone()).unwrap();
    let got = m.stable_descriptor(A, id, "node-7", Medium::Dram).unwrap();
    assert_eq!(
        (got.name.as_str(), got.host, got.size, got.endpoint, got.medium),
        ("node-7", d.host, d.size, d.endpoint, Medium::Dram)
    );
    assert_eq!(m.stable_descriptor(A, id, "node-8", Medium::Dram), Err(ErrorCode::INVALID_PARAMS), "another name");
    assert_eq!(m.stable_descriptor(A, id, "bad name", Medium::Dram), Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(m.stable_descriptor(B, id, "node-7", Medium::Dram), Err(ErrorCode::SEGMENT_NOT_FOUND), "not B's");
    let other = stable_segment_id("node-9");
    assert_eq!(m.stable_descriptor(A, other, "node-9", Medium::Dram), Err(ErrorCode::SEGMENT_NOT_FOUND));
    m.unmount_segment(A, id).unwrap();
    assert_eq!(m.stable_descriptor(A, id, "node-7", Medium::Dram), Err(ErrorCode::SEGMENT_NOT_FOUND), "unmounted");
    assert!(m.segment_directory().is_none(), "a master alone stores no descriptor");
    // A descriptor a reader would refuse is not made (no host).
    let hostless = stable_segment_id("hostless");
    m.mount_segment(A, SegmentDesc { id: hostless, host: String::new(), ..seg_desc(8, 4 * MIB) }).unwrap();
    assert_eq!(m.stable_descriptor(A, hostless, "hostless", Medium::Dram), Err(ErrorCode::INVALID_PARAMS));
}
