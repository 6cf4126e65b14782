//! Mounted segments and the range allocator over each.
//!
//! Each segment has its own allocator ([`RangeAllocator`]: best fit over free ranges, no cap on
//! the number of objects, exact-range reservation) behind its own mutex, so writers placing
//! replicas on different segments never contend. Every allocation gets a generation from the
//! segment's counter; its writer stamps it on the range's blocks before writing and readers
//! check it after copying (see `tycho-transfer`'s `Mapping`), which is what lets a freed range
//! be reused at once.
//!
//! With G KVPT groups a segment is cut into G slices of whole blocks, and each group container
//! has its own table of the segments mounted for it, each entry an allocator over that group's
//! slice only: masters that own different groups never hand out the same bytes, and a group's
//! log, replayed elsewhere, mounts and unmounts segments in that group's table alone. With G = 1
//! the single slice is the whole segment.
//!
//! With a cluster secret, a freed range stays *held* for its object's tenant while any
//! capability minted for it may still move bytes ([`Holding`]): the tenant reuses it at once,
//! other tenants get it only afterwards. A grant one tenant kept (read or write) therefore never
//! reaches another tenant's object, whatever the timing, and the transfer server cuts every
//! transfer off at its capability's deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use rand::Rng;
use tycho_proto::{
    segment_block_size, AllocStrategy, ClientId, ErrorCode, ReplicaDesc, SegmentDesc, SegmentId, WireResult,
};

use tycho_proto::auth::capability::{Capability, SegmentKey, CLOCK_SKEW_MS};
use tycho_proto::auth::Secret;

use crate::state::alloc::RangeAllocator;
use crate::state::clock::Clock;

/// When freed ranges may go to other tenants: with a cluster secret, only once every
/// capability minted for them is past its deadline by the holders' clocks.
pub struct Holding {
    clock: Arc<dyn Clock>,
    /// While this master only replays another's log: how long a grant that master may have
    /// minted for a range it frees may still last (ms); 0 while it serves.
    standby_grants_ms: AtomicU64,
}

impl Holding {
    /// Holding by `clock` (its Unix reading, on which capabilities are minted).
    pub fn new(clock: Arc<dyn Clock>) -> Holding {
        Holding { clock, standby_grants_ms: AtomicU64::new(0) }
    }

    /// Until when a range whose newest grant expires at `granted_until` (Unix ms) is held, and
    /// the time now (see [`HELD_PAST_EXPIRY_MS`]).
    fn until(&self, granted_until: u64) -> (u64, u64) {
        let now = self.clock.unix_now_ms();
        let standby = self.standby_grants_ms.load(Ordering::Relaxed);
        let granted = if standby > 0 { granted_until.max(now.saturating_add(standby)) } else { granted_until };
        (granted.saturating_add(HELD_PAST_EXPIRY_MS), now)
    }
}

/// How long past a capability's expiry its range is held: a holder accepts a capability up to
/// `CLOCK_SKEW_MS` past its expiry by its own clock, which may run `CLOCK_SKEW_MS` behind the
/// master's, and cuts its transfers off there; one more second covers a transfer call that
/// returns a little late (a descheduled thread, a timer's granularity).
pub const HELD_PAST_EXPIRY_MS: u64 = 2 * CLOCK_SKEW_MS + 1_000;

/// A range handed out by a segment allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegAlloc {
    /// Byte offset inside the segment.
    pub offset: u64,
    /// Bytes actually reserved (the size rounded up to the segment's block size).
    pub reserved: u64,
    /// Bytes asked for: what the value holds.
    pub len: u64,
    /// Generation its writer stamps on the range's blocks.
    pub gen: u32,
}

/// What a replica descriptor grants whoever receives it (see
/// `tycho_proto::auth::capability`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Grant {
    /// `RIGHT_READ`, `RIGHT_WRITE` and/or `RIGHT_RETIRE`.
    pub rights: u8,
    /// Wall-clock expiry, Unix milliseconds.
    pub expires_ms: u64,
    /// Epoch of the granting group.
    pub epoch: u64,
    /// The granting group.
    pub group: u16,
    /// Tag of the object's tenant.
    pub tenant: u64,
}

/// One mounted segment.
pub struct MountedSegment {
    /// As the client described it.
    pub desc: SegmentDesc,
    /// The client that mounted it.
    pub client: ClientId,
    /// Key of this segment generation, when the cluster has a secret.
    key: Option<SegmentKey>,
    /// How freed ranges are held for their tenants (with a secret).
    holding: Option<Arc<Holding>>,
    alive: AtomicBool,
    used: AtomicU64,
    stored: AtomicU64,
    next_gen: AtomicU32,
    /// The group whose slice this is, and where the slice starts in the segment.
    rank: u32,
    base: u64,
    /// Bytes of the slice (whole blocks).
    len: u64,
    /// Over the slice, offsets relative to `base`.
    alloc: Mutex<RangeAllocator>,
    /// Ranges of the slice set aside for VSegments (relative to `base`), set once on a group's
    /// primary: nothing is allocated there, and parts in use when they were set aside are
    /// taken as they are freed.
    fences: std::sync::OnceLock<Box<[(u64, u64)]>>,
    /// Bytes of the fences taken from the allocator so far (not counted in `used`).
    fenced: AtomicU64,
}

pub use tycho_proto::slice_of;

impl MountedSegment {
    fn new(
        desc: SegmentDesc,
        client: ClientId,
        secret: Option<&Secret>,
        holding: Option<Arc<Holding>>,
        (rank, groups): (u32, u32),
    ) -> MountedSegment {
        let unit = segment_block_size(desc.size);
        let slice = slice_of(desc.size, rank, groups);
        MountedSegment {
            key: secret.map(|s| SegmentKey::new(s, desc.id, desc.incarnation)),
            holding: secret.and(holding),
            rank,
            base: slice.start,
            len: (slice.end - slice.start) / unit * unit,
            alloc: Mutex::new(RangeAllocator::new(slice.end - slice.start, unit)),
            desc,
            client,
            alive: AtomicBool::new(true),
            used: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            next_gen: AtomicU32::new(1),
            fences: std::sync::OnceLock::new(),
            fenced: AtomicU64::new(0),
        }
    }

    /// Sets the ranges (segment offsets and lengths) that ordinary replicas must never take:
    /// the parts of them inside this slice are taken from the allocator now where free, and
    /// as they are freed otherwise. Once per mount; later calls change nothing. Returns the
    /// bytes taken now.
    pub fn fence(&self, ranges: &[(u64, u64)]) -> u64 {
        let unit = segment_block_size(self.desc.size);
        let (lo, hi) = (self.base, self.base + self.len);
        let mine: Vec<(u64, u64)> = ranges
            .iter()
            .filter_map(|&(o, l)| {
                // The part inside the slice, widened to whole blocks (a checked plan's extents
                // are block-aligned already; the slice starts and ends on blocks).
                let from = (o / unit * unit).max(lo);
                let to = o.saturating_add(l).checked_next_multiple_of(unit).unwrap_or(u64::MAX).min(hi);
                (from < to).then_some((from - lo, to - lo))
            })
            .collect();
        if mine.is_empty() || self.fences.set(mine.into_boxed_slice()).is_err() || !self.is_alive() {
            return 0;
        }
        let mut alloc = self.alloc.lock();
        let taken: u64 =
            self.fences.get().into_iter().flatten().map(|&(from, to)| alloc.take_unallocated(from, to)).sum();
        self.fenced.fetch_add(taken, Ordering::Relaxed);
        taken
    }

    /// Bytes of the slice set aside for VSegments and out of replicas' reach by now.
    pub fn fenced(&self) -> u64 {
        self.fenced.load(Ordering::Relaxed)
    }

    /// Bytes of the slice replicas may use: the slice less what is set aside for VSegments.
    pub fn room(&self) -> u64 {
        self.len.saturating_sub(self.fenced())
    }

    /// False once the segment is unmounted or its client expired; replicas on it are dead.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Bytes reserved by replicas.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Bytes the replicas' values hold (without the rounding to blocks).
    pub fn stored(&self) -> u64 {
        self.stored.load(Ordering::Relaxed)
    }

    /// The generation the next allocation here gets.
    pub fn next_gen(&self) -> u32 {
        self.next_gen.load(Ordering::Relaxed)
    }

    /// Makes later allocations here take generations from `gen` on (an import restoring where
    /// the primary's allocations had got to, so that no reader's generation is reused).
    pub fn raise_next_gen(&self, gen: u32) {
        self.next_gen.fetch_max(gen, Ordering::Relaxed);
    }

    /// Freed ranges held for their tenants: offset, bytes, until (Unix ms).
    pub fn held_ranges(&self) -> Vec<(u64, u64, u64)> {
        let held = self.alloc.lock().held_ranges();
        held.into_iter().map(|(o, l, u)| (o + self.base, l, u)).collect()
    }

    /// The group whose slice this is.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Bytes of this group's slice: the largest value it can hold.
    pub fn slice_len(&self) -> u64 {
        self.len
    }

    /// Whether `[offset, offset + len)` lies in this slice.
    pub fn in_slice(&self, offset: u64, len: u64) -> bool {
        offset >= self.base && offset.checked_add(len).is_some_and(|end| end <= self.base + self.len)
    }

    /// `offset` relative to the slice, if `[offset, offset + len)` lies in it.
    fn local(&self, offset: u64, len: u64) -> Option<u64> {
        self.in_slice(offset, len).then(|| offset - self.base)
    }

    /// Free fraction of the slice.
    fn free_ratio(&self) -> f64 {
        1.0 - self.used() as f64 / self.room().max(1) as f64
    }

    /// A fresh generation; 0 is never used (it is what unwritten blocks hold).
    fn gen(&self) -> u32 {
        loop {
            let g = self.next_gen.fetch_add(1, Ordering::Relaxed);
            if g != 0 {
                return g;
            }
        }
    }

    /// Reserves `size` bytes for an object of `tenant` (ranges held for that tenant first), or
    /// `None` if no range it may take is large enough.
    pub fn allocate(&self, size: u64, tenant: u64) -> Option<SegAlloc> {
        let now = self.holding.as_ref().map_or(0, |h| h.clock.unix_now_ms());
        self.allocate_held(size, tenant, now).map(|(a, _)| a)
    }

    /// [`allocate`](Self::allocate) at `unix_ms`, with the expiry (Unix ms) of the grants the
    /// range was held for (0 if it was free): the new replica must count them as its own.
    fn allocate_held(&self, size: u64, tenant: u64, unix_ms: u64) -> Option<(SegAlloc, u64)> {
        if !self.is_alive() {
            return None;
        }
        let (offset, reserved, held_until) = match &self.holding {
            Some(_) => self.alloc.lock().allocate_for(size, tenant, unix_ms)?,
            None => self.alloc.lock().allocate(size).map(|(o, r)| (o, r, 0))?,
        };
        self.used.fetch_add(reserved, Ordering::Relaxed);
        self.stored.fetch_add(size, Ordering::Relaxed);
        let granted = held_until.saturating_sub(HELD_PAST_EXPIRY_MS);
        Some((SegAlloc { offset: self.base + offset, reserved, len: size, gen: self.gen() }, granted))
    }

    /// Reserves exactly `[offset, offset + len)`, or `None` if any of it is taken or outside
    /// this group's slice.
    pub fn reserve(&self, offset: u64, len: u64) -> Option<SegAlloc> {
        if !self.is_alive() {
            return None;
        }
        let reserved = self.alloc.lock().reserve(self.local(offset, len)?, len)?;
        self.used.fetch_add(reserved, Ordering::Relaxed);
        self.stored.fetch_add(len, Ordering::Relaxed);
        Some(SegAlloc { offset, reserved, len, gen: self.gen() })
    }

    /// Reserves exactly the range a log record names, under the generation it names (a
    /// standby or an import replaying the primary's allocation). `None` if any of it is taken,
    /// the rounding differs, or the segment is dead.
    pub fn reserve_as(&self, offset: u64, reserved: u64, len: u64, gen: u32) -> Option<SegAlloc> {
        if !self.is_alive() || gen == 0 {
            return None;
        }
        let at = self.local(offset, len)?;
        let mut alloc = self.alloc.lock();
        if alloc.rounded(len) != Some(reserved) {
            return None;
        }
        alloc.reserve(at, len)?;
        drop(alloc);
        self.used.fetch_add(reserved, Ordering::Relaxed);
        self.stored.fetch_add(len, Ordering::Relaxed);
        // Later allocations on this master get generations after it.
        self.next_gen.fetch_max(gen.wrapping_add(1).max(1), Ordering::Relaxed);
        Some(SegAlloc { offset, reserved, len, gen })
    }

    /// Returns a range to the allocator. A dead segment's allocator is gone with it.
    pub fn free(&self, a: SegAlloc) {
        self.free_held(a, 0, 0);
    }

    /// Returns a range of an object of `tenant` whose newest capability expires at
    /// `granted_until` (Unix ms): held for that tenant while the capability may still be used
    /// (see [`Holding`]), then free for all.
    pub fn free_held(&self, a: SegAlloc, tenant: u64, granted_until: u64) {
        if !self.is_alive() {
            return;
        }
        let mut taken = 0;
        let freed = match (self.local(a.offset, a.reserved), &self.holding) {
            (None, _) => false,
            (Some(at), holding) => {
                let mut alloc = self.alloc.lock();
                let freed = match holding {
                    Some(h) => {
                        let (until, now) = h.until(granted_until);
                        alloc.hold(at, a.reserved, tenant, until, now)
                    }
                    None => alloc.free(at, a.reserved),
                };
                // What lies in a fence goes to the fence, not back to the replicas.
                if let Some(fences) = self.fences.get().filter(|_| freed) {
                    let end = at + a.reserved;
                    for &(from, to) in fences.iter().filter(|&&(from, to)| from < end && at < to) {
                        taken += alloc.take_unallocated(from.max(at), to.min(end));
                    }
                }
                freed
            }
        };
        if freed {
            self.used.fetch_sub(a.reserved, Ordering::Relaxed);
            self.fenced.fetch_add(taken, Ordering::Relaxed);
            self.stored.fetch_sub(a.len, Ordering::Relaxed);
        } else {
            tracing::error!(segment = %self.desc.id, offset = a.offset, "refused to free a range that is not allocated");
        }
    }

    /// The wire descriptor of a replica at `a` holding `len` bytes, carrying `cap`.
    fn describe(&self, a: &SegAlloc, len: u64, cap: Capability) -> ReplicaDesc {
        ReplicaDesc {
            cap,
            segment: self.desc.id,
            offset: a.offset,
            len,
            endpoint: self.desc.endpoint.clone(),
            host: self.desc.host.clone(),
            incarnation: self.desc.incarnation,
            gen: a.gen,
        }
    }

    /// The wire descriptor of a replica at `a` holding `len` bytes, carrying a capability for
    /// `grant`.
    pub fn replica_desc(&self, a: &SegAlloc, len: u64, grant: &Grant) -> ReplicaDesc {
        let cap = match &self.key {
            Some(k) => k.mint(
                a.offset,
                len,
                a.gen,
                Capability {
                    rights: grant.rights,
                    expires_ms: grant.expires_ms,
                    epoch: grant.epoch,
                    group: grant.group,
                    tenant: grant.tenant,
                    mac: [0; 16],
                },
            ),
            None => Capability::default(),
        };
        self.describe(a, len, cap)
    }
}

/// Where one replica lives: its segment and its range.
pub struct Replica {
    /// The segment; dead once unmounted.
    pub seg: Arc<MountedSegment>,
    /// The range.
    pub alloc: SegAlloc,
    /// The read capability last minted for it.
    pub read_cap: CapCache,
    /// Tag of its object's tenant, for whom the range is held once freed.
    pub tenant: u64,
    /// Latest expiry (Unix ms) of a capability minted for the range.
    pub granted_until: AtomicU64,
    /// Set on a replica that fan-out added (eviction drops it before its object).
    pub dynamic: Option<DynamicMark>,
}

/// The mark of a dynamic replica: it counts itself in a gauge while it exists.
pub type DynamicMark = Counted;

/// The read capability last minted for a replica: readers of a hot object share it while it
/// stays valid for long enough, instead of paying a MAC each.
#[derive(Default)]
pub struct CapCache(Mutex<Option<Capability>>);

impl Clone for CapCache {
    fn clone(&self) -> Self {
        CapCache::default()
    }
}

impl Clone for Replica {
    fn clone(&self) -> Self {
        Replica {
            seg: self.seg.clone(),
            alloc: self.alloc,
            read_cap: self.read_cap.clone(),
            tenant: self.tenant,
            granted_until: AtomicU64::new(self.granted_until.load(Ordering::Relaxed)),
            dynamic: self.dynamic.clone(),
        }
    }
}

impl Replica {
    /// A replica of `seg` at `alloc`, for an object of `tenant` (its tag).
    pub fn new(seg: Arc<MountedSegment>, alloc: SegAlloc, tenant: u64) -> Replica {
        Replica { seg, alloc, read_cap: CapCache::default(), tenant, granted_until: AtomicU64::new(0), dynamic: None }
    }

    /// Whether fan-out added it.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic.is_some()
    }

    /// The descriptor of this replica holding `len` bytes with a capability for `grant`; the
    /// range stays held for its tenant at least until the grant expires.
    pub fn desc(&self, len: u64, grant: &Grant) -> ReplicaDesc {
        self.granted_until.fetch_max(grant.expires_ms, Ordering::Relaxed);
        self.seg.replica_desc(&self.alloc, len, grant)
    }

    /// Counts grants a previous owner of the metadata may have minted for this replica up to
    /// `until` (Unix ms): a new primary does not know them.
    pub fn assume_granted_until(&self, until: u64) {
        self.granted_until.fetch_max(until, Ordering::Relaxed);
    }

    /// The descriptor a reader gets: with the read capability cached from an earlier read if
    /// it was granted under `epoch` and is valid at least until `fresh_until`, else with one
    /// minted for `grant()` (the object's tenant and group never change, so they need no
    /// check).
    pub fn read_desc(&self, len: u64, epoch: u64, fresh_until: u64, grant: impl FnOnce() -> Grant) -> ReplicaDesc {
        if self.seg.key.is_none() {
            return self.seg.replica_desc(&self.alloc, len, &Grant::default());
        }
        let mut cached = self.read_cap.0.lock();
        if let Some(c) = *cached {
            if c.epoch == epoch && c.expires_ms >= fresh_until {
                return self.seg.describe(&self.alloc, len, c);
            }
        }
        let d = self.desc(len, &grant());
        *cached = Some(d.cap);
        d
    }

    /// Frees the replica's range (held for its tenant while a grant of it may be in use).
    pub fn release(self) {
        self.seg.free_held(self.alloc, self.tenant, self.granted_until.load(Ordering::Relaxed));
    }
}

/// Where the replicas of a new object may go.
pub struct Placement<'a> {
    /// Replicas wanted.
    pub replicas: u32,
    /// Strategy.
    pub strategy: AllocStrategy,
    /// Segment names to use first.
    pub preferred: &'a [String],
    /// Host of the writer, for local-first placement.
    pub local_host: Option<&'a str>,
    /// Tag of the object's tenant.
    pub tenant: u64,
    /// Unix ms the placement is made at (read once for a whole batch): ranges held until then
    /// go back to everyone first. Unused without a cluster secret.
    pub unix_ms: u64,
}

/// All mounted segments.
#[derive(Default)]
pub struct SegmentTable {
    by_id: RwLock<HashMap<SegmentId, Arc<MountedSegment>>>,
    /// Ids of segments unmounted at some point (their owner may mount them again).
    retired: parking_lot::Mutex<std::collections::HashSet<SegmentId>>,
    /// The live segments as an immutable list, swapped on every mount and unmount so that
    /// placement reads it without holding the table lock.
    live: RwLock<Arc<Vec<Arc<MountedSegment>>>>,
    /// The cluster secret segment keys derive from; `None` mints no capabilities.
    secret: Option<Arc<Secret>>,
    /// How freed ranges are held for their tenants, with a secret.
    holding: Option<Arc<Holding>>,
    /// The group whose slices this table allocates in, and the cluster's group count G.
    slice: (u32, u32),
}

impl SegmentTable {
    /// An empty table of group `slice.0`'s slices (of `slice.1` groups) whose segments mint
    /// capabilities under `secret` and hold freed ranges for their tenants by `clock`.
    pub fn with_secret(secret: Option<Arc<Secret>>, clock: Arc<dyn Clock>, slice: (u32, u32)) -> SegmentTable {
        SegmentTable { secret, holding: Some(Arc::new(Holding::new(clock))), slice, ..SegmentTable::default() }
    }

    /// While `grants_ms` is not 0, this master replays another's log: a range it frees may
    /// carry grants that master minted up to `grants_ms` before, and is held that long.
    pub fn set_standby_grants(&self, grants_ms: u64) {
        if let Some(h) = &self.holding {
            h.standby_grants_ms.store(grants_ms, Ordering::Relaxed);
        }
    }

    /// Mounts `desc` for `client`; mounting the same segment again is a no-op. A newer
    /// incarnation from the same client replaces the old one (the third value says so: the
    /// caller sweeps its replicas). `reserve` lists ranges taken before anyone can allocate;
    /// the second value holds what each reservation got.
    #[allow(clippy::type_complexity)]
    pub fn mount(
        &self,
        client: ClientId,
        desc: SegmentDesc,
        reserve: &[(u64, u64)],
    ) -> WireResult<(Arc<MountedSegment>, Vec<Option<SegAlloc>>, bool)> {
        self.mount_then(client, desc, reserve, &[], || {})
    }

    /// [`SegmentTable::mount`], calling `accepted` once the mount is certain to happen and before
    /// anyone can allocate in it (the primary logs its record there, so that no write on the
    /// segment is logged before its mount). A mount that changes nothing does not call it.
    #[allow(clippy::type_complexity)]
    pub fn mount_then(
        &self,
        client: ClientId,
        desc: SegmentDesc,
        reserve: &[(u64, u64)],
        fences: &[(u64, u64)],
        accepted: impl FnOnce(),
    ) -> WireResult<(Arc<MountedSegment>, Vec<Option<SegAlloc>>, bool)> {
        if desc.size == 0 || desc.base.checked_add(desc.size).is_none() || desc.endpoint.is_empty() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let mut by_id = self.by_id.write();
        let mut replaced = false;
        if let Some(existing) = by_id.get(&desc.id) {
            if existing.client == client && existing.desc == desc {
                return Ok((existing.clone(), Vec::new(), false));
            }
            let same_memory = SegmentDesc { incarnation: existing.desc.incarnation, ..desc.clone() };
            if existing.client != client
                || existing.desc != same_memory
                || desc.incarnation <= existing.desc.incarnation
            {
                return Err(ErrorCode::SEGMENT_ALREADY_EXISTS);
            }
            replaced = true;
        }
        // Two segments served by one transfer server must not share bytes (the incarnation
        // this one replaces shares them by definition).
        let end = desc.base + desc.size;
        if by_id.values().any(|s| {
            s.desc.id != desc.id
                && s.desc.endpoint == desc.endpoint
                && s.desc.base < end
                && desc.base < s.desc.base + s.desc.size
        }) {
            return Err(ErrorCode::SEGMENT_ALREADY_EXISTS);
        }
        if replaced {
            // Its owner remounts it (it was expired while this master still held the old
            // mount): the old incarnation dies with its replicas.
            let old = by_id.remove(&desc.id).expect("present");
            old.alive.store(false, Ordering::Release);
            self.retired.lock().insert(desc.id);
        }
        accepted();
        let seg = Arc::new(MountedSegment::new(desc, client, self.secret.as_deref(), self.holding.clone(), self.slice));
        let reserved = reserve.iter().map(|&(o, l)| seg.reserve(o, l)).collect();
        // Set aside before anyone can place a replica here (a primary's mount once the
        // VSegment quota is known).
        if !fences.is_empty() {
            seg.fence(fences);
        }
        by_id.insert(seg.desc.id, seg.clone());
        self.publish(&by_id);
        Ok((seg, reserved, replaced))
    }

    /// Unmounts a segment: marks it dead and removes it from placement. Returns it so that the
    /// caller can sweep its replicas; `None` if it was not mounted.
    pub fn unmount(&self, id: SegmentId) -> Option<Arc<MountedSegment>> {
        let mut by_id = self.by_id.write();
        let seg = by_id.remove(&id)?;
        seg.alive.store(false, Ordering::Release);
        self.retired.lock().insert(id);
        self.publish(&by_id);
        Some(seg)
    }

    /// Forgets every segment, which dies with its replicas (a standby starting over).
    pub fn clear(&self) {
        let mut by_id = self.by_id.write();
        by_id.values().for_each(|s| s.alive.store(false, Ordering::Release));
        by_id.clear();
        self.retired.lock().clear();
        self.publish(&by_id);
    }

    /// Whether a segment with this id was unmounted before.
    pub fn was_unmounted(&self, id: SegmentId) -> bool {
        self.retired.lock().contains(&id)
    }

    fn publish(&self, by_id: &HashMap<SegmentId, Arc<MountedSegment>>) {
        let mut list: Vec<_> = by_id.values().cloned().collect();
        list.sort_by_key(|s| s.desc.id);
        *self.live.write() = Arc::new(list);
    }

    /// The segment with this id, if mounted.
    pub fn get(&self, id: SegmentId) -> Option<Arc<MountedSegment>> {
        self.by_id.read().get(&id).cloned()
    }

    /// Snapshot of the live segments.
    pub fn live(&self) -> Arc<Vec<Arc<MountedSegment>>> {
        self.live.read().clone()
    }

    /// Sum of slice sizes and of value bytes over live segments: what the eviction watermark
    /// compares, so that rounding small values up to blocks does not start eviction early.
    pub fn stored_usage(&self) -> (u64, u64) {
        let live = self.live();
        live.iter().fold((0, 0), |(t, u), s| (t + s.room(), u + s.stored()))
    }

    /// Sum of slice sizes (less what is set aside for VSegments) and of used bytes over live
    /// segments.
    pub fn usage(&self) -> (u64, u64) {
        let live = self.live();
        live.iter().fold((0, 0), |(t, u), s| (t + s.room(), u + s.used()))
    }

    /// Places up to `p.replicas` replicas of `size` bytes on distinct segments, best effort.
    /// Returns NO_AVAILABLE_HANDLE when not even one fits.
    pub fn place(&self, size: u64, p: &Placement<'_>) -> WireResult<Vec<Replica>> {
        let live = self.live();
        let want = p.replicas as usize;
        let mut out: Vec<Replica> = Vec::with_capacity(want);
        let try_seg = |seg: &Arc<MountedSegment>, out: &mut Vec<Replica>| {
            if out.len() < want && !out.iter().any(|r| Arc::ptr_eq(&r.seg, seg)) {
                if let Some((alloc, granted)) = seg.allocate_held(size, p.tenant, p.unix_ms) {
                    let r = Replica::new(seg.clone(), alloc, p.tenant);
                    r.assume_granted_until(granted);
                    out.push(r);
                }
            }
        };
        for name in p.preferred {
            if let Some(seg) = live.iter().find(|s| &s.desc.name == name) {
                try_seg(seg, &mut out);
            }
        }
        if out.len() < want {
            if let Some(host) = p.local_host.filter(|_| p.strategy == AllocStrategy::LocalFirst) {
                for seg in live.iter().filter(|s| s.desc.host == host) {
                    try_seg(seg, &mut out);
                }
            }
        }
        if out.len() < want && !live.is_empty() {
            match p.strategy {
                AllocStrategy::FreeRatioFirst => {
                    let mut order: Vec<_> = live.iter().collect();
                    order.sort_by(|a, b| b.free_ratio().total_cmp(&a.free_ratio()));
                    for seg in order {
                        try_seg(seg, &mut out);
                    }
                }
                AllocStrategy::Random | AllocStrategy::LocalFirst => {
                    let start = rand::thread_rng().gen_range(0..live.len());
                    for i in 0..live.len() {
                        try_seg(&live[(start + i) % live.len()], &mut out);
                        if out.len() == want {
                            break;
                        }
                    }
                }
            }
        }
        if out.is_empty() {
            return Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        Ok(out)
    }
}

/// A thing counted in a shared gauge while it exists: taking one adds 1, dropping it (on
/// whatever path) gives the 1 back, and a clone counts again.
pub struct Counted(Arc<AtomicU64>);

impl Counted {
    /// One more in `count`.
    pub fn take(count: &Arc<AtomicU64>) -> Counted {
        count.fetch_add(1, Ordering::Relaxed);
        Counted(count.clone())
    }
}

impl Clone for Counted {
    fn clone(&self) -> Self {
        Counted::take(&self.0)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tycho_proto::segment_block_size;

    /// Random placement of `replicas` replicas, `preferred` first, with no tenant or holding.
    fn random(replicas: u32, preferred: &[String]) -> Placement<'_> {
        Placement { replicas, strategy: AllocStrategy::Random, preferred, local_host: None, tenant: 0, unix_ms: 0 }
    }

    fn desc(id: u128, endpoint: &str, base: u64, size: u64) -> SegmentDesc {
        SegmentDesc {
            id: SegmentId(id),
            name: format!("seg{id}"),
            base,
            size,
            endpoint: endpoint.into(),
            host: "h".into(),
            incarnation: 1,
        }
    }

    #[test]
    fn allocator_reuses_freed_space_and_counts_bytes() {
        let t = SegmentTable::default();
        t.mount(ClientId(1), desc(1, "e:1", 0, 1 << 20), &[]).unwrap();
        let seg = t.get(SegmentId(1)).unwrap();
        let a = seg.allocate(1000, 0).unwrap();
        assert!(a.reserved >= 1000 && a.offset % tycho_proto::MIN_BLOCK_SIZE == 0);
        assert_eq!(seg.used(), a.reserved);
        assert!(seg.allocate(2 << 20, 0).is_none());
        seg.free(a);
        assert_eq!(seg.used(), 0);
        assert!(seg.allocate(1 << 20, 0).is_some());
    }

    #[test]
    fn mount_is_idempotent_and_rejects_conflicts() {
        let t = SegmentTable::default();
        t.mount(ClientId(1), desc(1, "e:1", 0, 4096), &[]).unwrap();
        t.mount(ClientId(1), desc(1, "e:1", 0, 4096), &[]).unwrap();
        assert_eq!(t.mount(ClientId(2), desc(1, "e:1", 0, 4096), &[]).err(), Some(ErrorCode::SEGMENT_ALREADY_EXISTS));
        assert_eq!(
            t.mount(ClientId(1), desc(2, "e:1", 4000, 4096), &[]).err(),
            Some(ErrorCode::SEGMENT_ALREADY_EXISTS)
        );
        t.mount(ClientId(1), desc(3, "e:1", 4096, 4096), &[]).unwrap();
        t.mount(ClientId(1), desc(4, "e:2", 0, 4096), &[]).unwrap();
        assert_eq!(t.mount(ClientId(1), desc(5, "e:3", 0, 0), &[]).err(), Some(ErrorCode::INVALID_PARAMS));
        assert_eq!(t.live().len(), 3);
    }

    #[test]
    fn replicas_go_to_distinct_segments_best_effort() {
        let t = SegmentTable::default();
        for i in 0..3 {
            t.mount(ClientId(1), desc(i, &format!("e:{i}"), 0, 1 << 20), &[]).unwrap();
        }
        let p = random(5, &[]);
        let r = t.place(1000, &p).unwrap();
        assert_eq!(r.len(), 3);
        let mut ids: Vec<_> = r.iter().map(|r| r.seg.desc.id).collect();
        ids.dedup();
        assert_eq!(ids.len(), 3);
        let pref = vec!["seg2".to_string()];
        let p = random(1, &pref);
        assert_eq!(t.place(10, &p).unwrap()[0].seg.desc.id, SegmentId(2));
        let p = random(1, &[]);
        assert_eq!(t.place(2 << 20, &p).err(), Some(ErrorCode::NO_AVAILABLE_HANDLE));
    }

    #[test]
    fn a_fenced_range_is_never_allocated_and_joins_the_fence_as_it_is_freed() {
        let t = SegmentTable::default();
        t.mount(ClientId(1), desc(1, "e:1", 0, 1 << 20), &[]).unwrap();
        let seg = t.get(SegmentId(1)).unwrap();
        let first = seg.allocate(64 << 10, 0).unwrap();
        assert_eq!(first.offset, 0);
        // Set aside [32 KiB, 544 KiB): the half of `first` inside stays allocated.
        assert_eq!(seg.fence(&[(32 << 10, 512 << 10)]), 480 << 10);
        assert_eq!((seg.fenced(), seg.room()), (480 << 10, (1 << 20) - (480 << 10)));
        assert_eq!(seg.fence(&[(0, 1 << 20)]), 0, "set once");
        let mut got = Vec::new();
        while let Some(a) = seg.allocate(4096, 0) {
            assert!(a.offset + a.reserved <= 32 << 10 || a.offset >= 544 << 10, "allocated {} in the fence", a.offset);
            got.push(a);
        }
        assert_eq!(seg.used(), (64 << 10) + got.len() as u64 * 4096);
        // Freeing `first` gives its part in the fence to the fence, the rest to replicas.
        seg.free(first);
        assert_eq!(seg.fenced(), 512 << 10);
        assert_eq!(seg.allocate(64 << 10, 0), None, "only its 32 KiB outside the fence came back");
        let back = seg.allocate(32 << 10, 0).unwrap();
        assert_eq!(back.offset, 0);
        // A range outside the slice sets nothing aside; one off the blocks, the blocks it
        // touches.
        let other = SegmentTable::default();
        other.mount(ClientId(1), desc(2, "e:2", 0, 1 << 20), &[]).unwrap();
        assert_eq!(other.get(SegmentId(2)).unwrap().fence(&[(2 << 20, 4096), (10, 60)]), 128);
    }

    #[test]
    fn free_ratio_first_picks_emptiest() {
        let t = SegmentTable::default();
        t.mount(ClientId(1), desc(1, "e:1", 0, 1 << 20), &[]).unwrap();
        t.mount(ClientId(1), desc(2, "e:2", 0, 1 << 20), &[]).unwrap();
        t.get(SegmentId(1)).unwrap().allocate(500_000, 0).unwrap();
        let p = Placement {
            replicas: 1,
            strategy: AllocStrategy::FreeRatioFirst,
            preferred: &[],
            local_host: None,
            tenant: 0,
            unix_ms: 0,
        };
        assert_eq!(t.place(10, &p).unwrap()[0].seg.desc.id, SegmentId(2));
    }

    #[test]
    fn huge_segments_scale_the_unit() {
        let s = MountedSegment::new(desc(1, "e", 0, 1 << 40), ClientId(1), None, None, (0, 1));
        assert!(segment_block_size(1 << 40) > tycho_proto::MIN_BLOCK_SIZE);
        let a = s.allocate(1 << 30, 0).unwrap();
        assert!(a.reserved >= 1 << 30);
    }

    #[test]
    fn every_allocation_gets_a_new_generation_and_a_remount_replaces_the_old_incarnation() {
        let t = SegmentTable::default();
        t.mount(ClientId(1), desc(1, "e:1", 0, 1 << 20), &[]).unwrap();
        let seg = t.get(SegmentId(1)).unwrap();
        let a = seg.allocate(64, 0).unwrap();
        seg.free(a);
        let b = seg.allocate(64, 0).unwrap();
        assert_eq!(a.offset, b.offset, "freed space is reused at once");
        assert_ne!(a.gen, b.gen);
        // Same incarnation again: idempotent. A newer one from its owner replaces it.
        t.mount(ClientId(1), desc(1, "e:1", 0, 1 << 20), &[]).unwrap();
        assert!(seg.is_alive());
        assert_eq!(
            t.mount(ClientId(2), SegmentDesc { incarnation: 2, ..desc(1, "e:1", 0, 1 << 20) }, &[]).err(),
            Some(ErrorCode::SEGMENT_ALREADY_EXISTS)
        );
        t.mount(ClientId(1), SegmentDesc { incarnation: 2, ..desc(1, "e:1", 0, 1 << 20) }, &[]).unwrap();
        assert!(!seg.is_alive());
        assert_eq!(t.get(SegmentId(1)).unwrap().desc.incarnation, 2);
        assert_eq!(
            t.mount(ClientId(1), SegmentDesc { incarnation: 1, ..desc(1, "e:1", 0, 1 << 20) }, &[]).err(),
            Some(ErrorCode::SEGMENT_ALREADY_EXISTS)
        );
    }

    #[test]
    fn exact_reservations_hold_their_range() {
        let t = SegmentTable::default();
        t.mount(ClientId(1), desc(1, "e:1", 0, 4096), &[]).unwrap();
        let seg = t.get(SegmentId(1)).unwrap();
        let r = seg.reserve(0, 4000).unwrap();
        assert_eq!(r.reserved, 4032);
        assert!(seg.allocate(128, 0).is_none());
        assert!(seg.reserve(0, 64).is_none());
        assert!(seg.allocate(64, 0).is_some());
    }

    #[test]
    fn a_group_allocates_only_in_its_own_slice() {
        let size = 1u64 << 20;
        let quarter = size / 4;
        let clock: Arc<dyn Clock> = Arc::new(crate::state::clock::ManualClock::new(0));
        let tables: Vec<SegmentTable> =
            (0..4).map(|rank| SegmentTable::with_secret(None, clock.clone(), (rank, 4))).collect();
        for (rank, t) in tables.iter().enumerate() {
            t.mount(ClientId(1), desc(1, "e:1", 0, size), &[]).unwrap();
            let seg = t.get(SegmentId(1)).unwrap();
            assert_eq!((seg.rank(), seg.slice_len()), (rank as u32, quarter));
            assert_eq!(slice_of(size, rank as u32, 4), rank as u64 * quarter..(rank as u64 + 1) * quarter);
            let a = seg.allocate(1000, 0).unwrap();
            assert!(seg.in_slice(a.offset, a.reserved), "{a:?} outside slice {rank}");
            // Full: a slice does not spill into its neighbour.
            assert!(seg.allocate(quarter, 0).is_none());
            let p = random(1, &[]);
            assert_eq!(t.place(quarter, &p).err(), Some(ErrorCode::NO_AVAILABLE_HANDLE));
            assert_eq!(t.usage().0, quarter);
        }
        // Exact reservations must lie in the table's slice; a free goes back to it.
        let seg = tables[3].get(SegmentId(1)).unwrap();
        assert!(seg.reserve(0, 4096).is_none());
        assert!(seg.reserve(3 * quarter - 64, 128).is_none());
        let r = seg.reserve(size - 4096, 4096).unwrap();
        seg.free(r);
        assert!(seg.reserve(size - 4096, 4096).is_some());
        // Slices cover the segment, in whole blocks, whatever G.
        for (size, groups) in [(1u64 << 20, 3u32), (5 << 20, 7), (1 << 30, 64)] {
            let mut at = 0;
            for rank in 0..groups {
                let s = slice_of(size, rank, groups);
                assert_eq!(s.start, at);
                assert_eq!(s.start % segment_block_size(size), 0);
                at = s.end;
            }
            assert_eq!(at, size);
        }
    }
}
