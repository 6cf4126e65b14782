//! Memory that segments are made of: anonymous shared memory (memfd) mapped into this
//! process, and mappings of other processes' segments on the same host.
//!
//! A segment's memory is a memfd, so it disappears with its last user: no file is left in
//! `/dev/shm` when a process dies. It is sealed against shrinking and growing, so a peer that
//! maps it can never be crashed by a SIGBUS from its owner truncating it. Peers of the same user
//! on the same host receive the memfd itself over a Unix socket (see `local`), read-only unless
//! they were granted a write, map it, and copy with one `memcpy`. No path to a segment ever
//! comes from the network.
//!
//! ## Generations
//!
//! The master frees a range as soon as its object is removed, replaced or evicted, and may
//! hand it to a new write while a reader is still copying the old value. What keeps that
//! reader from returning foreign bytes is a generation word per block of the segment (blocks
//! of [`segment_block_size`] bytes, the master's allocation unit, so no block is shared by two
//! live ranges), kept in the same memfd after the data, and an incarnation word that the owner
//! bumps before every (re)mount:
//!
//! ```text
//! [0, 4096)              header: magic | version | block size | data size | blocks | incarnation
//!                                | slices | one incarnation per slice
//! [4096, 4096 + size)    data
//! [G, ...)               one u32 generation per block   (G = 4096 + size rounded up to a page)
//! ```
//!
//! A writer stores its range's generation into every block it is about to write, then a full
//! fence, then its bytes. A reader copies, then an acquire fence, then checks that the incarnation
//! and every block of its range still carry what its replica descriptor says. If any byte it
//! copied came from a later writer, that writer's stamp precedes the byte and the reader's check
//! follows its copy, so the check sees the new stamp and the read fails (RANGE_REUSED) instead
//! of returning the bytes. A range's generation is unique within an incarnation (the counter
//! would have to wrap 2^32 times within one lease-bounded read to repeat).
//!
//! ## Slices
//!
//! In a cluster of G KVPT groups each group's primary allocates in its own slice of the
//! segment (`tycho_proto::slice_of`), and each judges the owner's liveness on its own. The
//! owner then keeps one incarnation per slice ([`Mapping::set_slices`]): a primary that expired
//! it makes it start new incarnations of that primary's slices only ([`Mapping::bump_slices`]),
//! and the ranges of other slices stay good. Incarnations come from one counter (the header's
//! `incarnation` word), so that none is ever given to two slices, and a range is checked
//! against the slice it lies in.
//!
//! A second array holds one word per 4 KiB page of data, the *page summary*: a writer stores
//! its generation there too, for every page it writes into. A page that lies wholly inside a
//! reader's range can only be written by a range that overlaps the reader's, so for such pages
//! the reader checks the summary alone; it checks block words only in the partial pages at the
//! ends of its range. A 1 MiB read checks 256 words instead of 16,384.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, Ordering};

use tycho_proto::{segment_block_size, slice_rank, ErrorCode, MAX_SLICES};

use crate::error::TransferError;

const PAGE: usize = 4096;
/// First word of a segment's generation header.
const GEN_MAGIC: u64 = u64::from_le_bytes(*b"TYGENS\0\0");
/// Layout version of the generation area; a mapping of another version is refused.
const GEN_VERSION: u32 = 3;
/// Incarnation an owner writes when it lets go of a segment: peers drop their mappings of it,
/// and every range of it fails its check. Never handed out.
const CLOSED: u32 = u32::MAX;
/// Seals every segment memfd carries: its size can never change.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// The fixed header in front of the generation words.
#[repr(C)]
struct GenHeader {
    magic: u64,
    version: u32,
    block_shift: u32,
    data_len: u64,
    blocks: u64,
    /// The last incarnation handed out (or CLOSED); with no slices, the segment's.
    incarnation: AtomicU32,
    /// How many slices have incarnations of their own (0: none, the segment has one).
    slices: AtomicU32,
    /// The incarnation of each slice, by group rank.
    slice_incarnations: [AtomicU32; MAX_SLICES as usize],
}

const _: () = assert!(std::mem::size_of::<GenHeader>() <= PAGE);

/// Where the block generation words start and how large the whole file is, for `len` data
/// bytes. The page summaries follow the block words (see [`summary_offset`]).
fn layout(len: usize) -> Option<(usize, usize, u32)> {
    let block = segment_block_size(len as u64);
    let blocks = (len as u64).div_ceil(block) as usize;
    let gen_off = PAGE.checked_add(len.checked_next_multiple_of(PAGE)?)?;
    let sum_off = gen_off.checked_add(blocks.checked_mul(4)?.checked_next_multiple_of(PAGE)?)?;
    let total = sum_off.checked_add(len.div_ceil(PAGE).checked_mul(4)?.checked_next_multiple_of(PAGE)?)?;
    Some((gen_off, total, block.trailing_zeros()))
}

/// Where the page summaries start: after the block words of `len` data bytes.
fn summary_offset(len: usize, gen_off: usize, block_shift: u32) -> usize {
    let blocks = (len as u64).div_ceil(1 << block_shift) as usize;
    gen_off + (blocks * 4).next_multiple_of(PAGE)
}

/// A mapped region, owned or borrowed from a peer.
pub struct Mapping {
    /// The whole mapping: header, data, generation words.
    map: *mut u8,
    /// The data: `map` + one page.
    ptr: *mut u8,
    len: usize,
    /// Bytes mapped.
    map_len: usize,
    gen_off: usize,
    block_shift: u32,
    /// Whether the memory is mapped writable (a peer's segment is read-only unless a write
    /// was granted).
    writable: bool,
    /// For a peer's segment: the owner's pid and its start time, to tell when it has exited.
    owner: Option<(i32, u64)>,
    /// The memfd, passed on to peers that present a grant.
    fd: OwnedFd,
    /// Whether peers may map it: not when the data lives in a file a user named (the file
    /// could be truncated under them; only the memfd is sealed), see [`Mapping::over_file`].
    shareable: bool,
    /// For a segment over a file: the file, open as long as the segment lives, which holds the
    /// lock on its range.
    _file: Option<std::fs::File>,
}

// SAFETY: the mapping is plain shared memory; concurrent access to disjoint ranges is the
// protocol's job (the master never hands out overlapping live ranges), and every access goes
// through bounds-checked copies below.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Creates `len` bytes of shared memory, pre-faulted so that the first write does not pay
    /// page faults.
    pub fn create(name: &str, len: usize) -> Result<Mapping, TransferError> {
        let (fd, total, gen_off, block_shift) = Self::sealed_memfd(name, len)?;
        let m = Self::map(fd, len, total, gen_off, block_shift, true, true)?;
        m.write_header();
        Ok(m)
    }

    /// A segment whose `len` data bytes are those of `file` from `offset` on (a page multiple),
    /// mapped shared, so that what is stored lands in the file. Its header and generation
    /// words live in a sealed memfd as usual, but the segment is never handed to peers: a
    /// file, unlike the memfd, cannot be sealed against truncation, which would crash a peer
    /// mapping it with SIGBUS. Same-host peers reach it over the transfer server instead. The
    /// caller keeps the file at least `offset + len` bytes long while the segment lives.
    pub fn over_file(name: &str, file: &std::fs::File, offset: u64, len: usize) -> Result<Mapping, TransferError> {
        if !offset.is_multiple_of(PAGE as u64) {
            return Err(TransferError::InvalidRange(format!("offset {offset} is not a multiple of {PAGE}")));
        }
        let file_len = file.metadata()?.len();
        if offset.checked_add(len as u64).is_none_or(|end| end > file_len) {
            return Err(TransferError::InvalidRange(format!(
                "{len} bytes at {offset} do not fit in a file of {file_len} bytes"
            )));
        }
        // One segment per range of a file: a second mount of the same bytes (in this process or
        // another) would hand them out twice. An open-file-description lock, held as long as the
        // segment keeps the file open, refuses it.
        // SAFETY: a zeroed flock is a valid value; the fields set below describe the range.
        let mut range: libc::flock = unsafe { std::mem::zeroed() };
        range.l_type = libc::F_WRLCK as libc::c_short;
        range.l_whence = libc::SEEK_SET as libc::c_short;
        range.l_start = offset as libc::off_t;
        range.l_len = len as libc::off_t;
        let file = file.try_clone()?;
        // SAFETY: fcntl on an owned fd with a valid flock.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &range) } != 0 {
            return Err(TransferError::InvalidRange(format!(
                "bytes {offset}..{} of the file are locked (another segment's?): {}",
                offset + len as u64,
                std::io::Error::last_os_error()
            )));
        }
        let (fd, total, gen_off, block_shift) = Self::sealed_memfd(name, len)?;
        // The memfd's data pages are never touched (the file is mapped over them), so it is
        // mapped without pre-faulting.
        let mut m = Self::map(fd, len, total, gen_off, block_shift, true, false)?;
        let data_len = len.next_multiple_of(PAGE);
        // SAFETY: replaces the data pages of our own fresh mapping (inside it: `total` covers
        // a page of header plus the data rounded up to a page) with the file's pages; offset
        // and length were checked against the file.
        let ptr = unsafe {
            libc::mmap(
                m.ptr.cast(),
                data_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // A failed MAP_FIXED may have unmapped the range already: cover it again, so that
            // no other mapping of this process can land there before the drop unmaps it.
            // SAFETY: the range is our own mapping's, as above.
            unsafe {
                libc::mmap(
                    m.ptr.cast(),
                    data_len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            return Err(TransferError::Io(e));
        }
        m.write_header();
        m.shareable = false;
        m._file = Some(file);
        Ok(m)
    }

    /// A memfd of the layout of a `len`-byte segment, sealed against resizing.
    fn sealed_memfd(name: &str, len: usize) -> Result<(OwnedFd, usize, usize, u32), TransferError> {
        if len == 0 {
            return Err(TransferError::InvalidRange("segment size must be positive".into()));
        }
        let (gen_off, total, block_shift) =
            layout(len).ok_or_else(|| TransferError::InvalidRange("segment size too large".into()))?;
        let cname = CString::new(name).map_err(|_| TransferError::InvalidRange("bad segment name".into()))?;
        // SAFETY: memfd_create takes a valid C string and flags; it returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(TransferError::Io(std::io::Error::last_os_error()));
        }
        // SAFETY: raw is a freshly created fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on an owned fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), total as libc::off_t) } != 0 {
            return Err(TransferError::Io(std::io::Error::last_os_error()));
        }
        // SAFETY: fcntl on an owned fd.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(TransferError::Io(std::io::Error::last_os_error()));
        }
        Ok((fd, total, gen_off, block_shift))
    }

    fn write_header(&self) {
        let block_shift = self.block_shift;
        // SAFETY: the header page lies inside the mapping and nothing else uses it yet.
        unsafe {
            let h = self.map as *mut GenHeader;
            (*h).version = GEN_VERSION;
            (*h).block_shift = block_shift;
            (*h).data_len = self.len as u64;
            (*h).blocks = (self.len as u64).div_ceil(1 << block_shift);
            (*h).magic = GEN_MAGIC;
        }
    }

    /// Maps a peer's segment from its memfd (received over the local socket from process
    /// `owner`). The memfd must be sealed against size changes; its layout comes from the
    /// generation header, which must be of this build's version. `writable` maps it for writing,
    /// which needs a descriptor opened for writing.
    pub fn from_fd(fd: OwnedFd, writable: bool, owner: i32) -> Result<Mapping, TransferError> {
        let bad = |why: &str| TransferError::InvalidRange(format!("segment memory from process {owner}: {why}"));
        // SAFETY: fcntl on an owned fd.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) != (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) {
            return Err(bad("not sealed against resizing"));
        }
        let file = std::fs::File::from(fd);
        let actual = file.metadata()?.len() as usize;
        // Read the header with pread, and check that it describes this file, before mapping.
        let mut probe = vec![0u8; std::mem::size_of::<GenHeader>()];
        use std::os::unix::fs::FileExt;
        if actual < PAGE {
            return Err(bad("too small to be a segment"));
        }
        file.read_exact_at(&mut probe, 0)?;
        if u64::from_le_bytes(probe[0..8].try_into().expect("8 bytes")) != GEN_MAGIC {
            return Err(bad("no segment header"));
        }
        let len = u64::from_le_bytes(probe[16..24].try_into().expect("8 bytes")) as usize;
        if len == 0 || layout(len).is_none_or(|(_, total, _)| total != actual) {
            return Err(bad("the header does not match the file's size"));
        }
        let (gen_off, total, block_shift) = layout(len).expect("checked above");
        let mut m = Self::map(OwnedFd::from(file), len, total, gen_off, block_shift, writable, true)?;
        // SAFETY: the header page is inside the mapping.
        let (version, shift) = unsafe {
            let h = m.map as *const GenHeader;
            ((*h).version, (*h).block_shift)
        };
        if version != GEN_VERSION || shift != block_shift {
            return Err(bad(&format!("generation layout version {version}, block shift {shift}")));
        }
        m.owner = Some((owner, start_time(owner).unwrap_or(0)));
        Ok(m)
    }

    /// A descriptor of this segment's memfd for a peer: read-only unless `writable`.
    /// Fails (Unsupported) for a segment over a file, which peers reach over TCP instead.
    pub fn fd_for_peer(&self, writable: bool) -> std::io::Result<OwnedFd> {
        if !self.shareable {
            return Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "a segment over a file is not shared"));
        }
        if writable {
            return self.fd.try_clone();
        }
        // Reopening through /proc gives a new open file description with read-only access.
        let path = CString::new(format!("/proc/self/fd/{}", self.fd.as_raw_fd())).expect("no NUL");
        // SAFETY: a valid C string; the result is checked.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }

    /// Whether peers on this host may map it (see [`Mapping::over_file`]).
    pub fn is_shareable(&self) -> bool {
        self.shareable
    }

    /// Whether this mapping may be written.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// Maps `total` bytes of `fd`, pre-faulted when `populate` (the default for a segment:
    /// otherwise the first copy into each page pays a page fault, which can cost as much as
    /// the copy itself).
    #[allow(clippy::too_many_arguments)]
    fn map(
        fd: OwnedFd,
        len: usize,
        total: usize,
        gen_off: usize,
        block_shift: u32,
        writable: bool,
        populate: bool,
    ) -> Result<Mapping, TransferError> {
        let flags = if populate { libc::MAP_SHARED | libc::MAP_POPULATE } else { libc::MAP_SHARED };
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: mapping a valid fd of at least `total` bytes; the result is checked.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), total, prot, flags, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(TransferError::Io(std::io::Error::last_os_error()));
        }
        let map = ptr as *mut u8;
        // SAFETY: the data starts one page into the mapping, which is larger than a page.
        let data = unsafe { map.add(PAGE) };
        Ok(Mapping {
            map,
            ptr: data,
            len,
            map_len: total,
            gen_off,
            block_shift,
            writable,
            owner: None,
            fd,
            shareable: true,
            _file: None,
        })
    }

    fn header(&self) -> &GenHeader {
        // SAFETY: the header page lies inside the mapping, which outlives the reference; its
        // only mutable field is atomic.
        unsafe { &*(self.map as *const GenHeader) }
    }

    fn gens(&self, offset: u64, len: usize) -> &[AtomicU32] {
        let first = (offset >> self.block_shift) as usize;
        let last = ((offset + len as u64 - 1) >> self.block_shift) as usize;
        // SAFETY: callers pass ranges checked against the data size, whose blocks all have a
        // word in the generation area; atomics may alias memory other processes write.
        unsafe {
            let base = self.map.add(self.gen_off) as *const AtomicU32;
            std::slice::from_raw_parts(base.add(first), last - first + 1)
        }
    }

    /// Whether any block word of `[offset, offset + len)` differs from `gen` (0 if none).
    fn blocks_differ(&self, offset: u64, len: usize, gen: u32) -> u32 {
        let (words, n) = self.gen_words(offset, len);
        words_differ(words, n, gen)
    }

    /// The page summary words of the pages `[offset, offset + len)` touches (none for an
    /// empty range).
    fn summary_words(&self, offset: u64, len: usize) -> (*mut u32, usize) {
        if len == 0 {
            return (std::ptr::null_mut(), 0);
        }
        let first = offset as usize / PAGE;
        let last = (offset as usize + len - 1) / PAGE;
        // SAFETY: pages of a checked range have their words in the summary area.
        let base = unsafe { self.map.add(summary_offset(self.len, self.gen_off, self.block_shift)) } as *mut u32;
        // SAFETY: as above.
        (unsafe { base.add(first) }, last - first + 1)
    }

    /// The generation words of a checked range, as a pointer and a count, for the bulk stamp
    /// and check (none for an empty range). Other processes may write them at any time, as
    /// they may write the data: they are used only between fences, like the data.
    fn gen_words(&self, offset: u64, len: usize) -> (*mut u32, usize) {
        if len == 0 {
            return (std::ptr::null_mut(), 0);
        }
        let words = self.gens(offset, len);
        (words.as_ptr() as *mut u32, words.len())
    }

    /// The last incarnation handed out: the segment's, when it has no slices (see
    /// [`Mapping::incarnation_of`] for a range's).
    pub fn incarnation(&self) -> u32 {
        self.header().incarnation.load(Ordering::Acquire)
    }

    /// Starts the incarnations of memory never mounted (incarnation 0) at `first` rather than
    /// at 1: a stable segment's id outlives its process, and a new process's incarnations must
    /// not repeat those its earlier run handed out (readers check ranges against them). False,
    /// and nothing changed, for memory mounted before or a `first` of 0 or CLOSED.
    pub fn start_incarnations_at(&self, first: u32) -> bool {
        if first == 0 || first == CLOSED {
            return false;
        }
        self.header().incarnation.compare_exchange(0, first - 1, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// A new incarnation from the counter (never 0 nor CLOSED).
    fn next_incarnation(&self) -> u32 {
        let h = &self.header().incarnation;
        loop {
            let n = h.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
            if n != CLOSED && n != 0 {
                return n;
            }
        }
    }

    /// Starts a new incarnation of the whole segment, every slice included (before the owner
    /// mounts it again) and returns it: every reader and writer holding ranges of an earlier one
    /// fails from now on.
    pub fn bump_incarnation(&self) -> u32 {
        let n = self.next_incarnation();
        let h = self.header();
        let slices = self.slices() as usize;
        for s in &h.slice_incarnations[..slices] {
            s.store(n, Ordering::Release);
        }
        fence(Ordering::SeqCst);
        n
    }

    /// Gives each of `groups` slices an incarnation of its own, all the segment's current one
    /// (before the owner first mounts it in a cluster of `groups` groups). False, and nothing
    /// changed, when `groups` is below 2 or above [`MAX_SLICES`]: the segment keeps one
    /// incarnation.
    pub fn set_slices(&self, groups: u32) -> bool {
        if !(2..=MAX_SLICES).contains(&groups) {
            return false;
        }
        let h = self.header();
        let now = h.incarnation.load(Ordering::Acquire);
        for s in &h.slice_incarnations[..groups as usize] {
            s.store(now, Ordering::Release);
        }
        h.slices.store(groups, Ordering::Release);
        fence(Ordering::SeqCst);
        true
    }

    /// How many slices have incarnations of their own (0: none).
    pub fn slices(&self) -> u32 {
        self.header().slices.load(Ordering::Acquire).min(MAX_SLICES)
    }

    /// Back to one incarnation for the whole segment (before mounting it where the cluster has
    /// one group, or more than [`MAX_SLICES`]); the caller then starts a new incarnation.
    pub fn clear_slices(&self) {
        self.header().slices.store(0, Ordering::Release);
        fence(Ordering::SeqCst);
    }

    /// The incarnation of slice `rank` (the segment's, without slices).
    pub fn slice_incarnation(&self, rank: u32) -> u32 {
        let h = self.header();
        match self.slices() {
            n if rank < n => h.slice_incarnations[rank as usize].load(Ordering::Acquire),
            _ => h.incarnation.load(Ordering::Acquire),
        }
    }

    /// Starts one new incarnation for the slices of `ranks` and returns it: readers and writers
    /// holding ranges of those slices fail from now on; other slices keep theirs. Without
    /// slices, a new incarnation of the whole segment.
    pub fn bump_slices(&self, ranks: &[u32]) -> u32 {
        let h = self.header();
        let slices = self.slices();
        if slices == 0 {
            return self.bump_incarnation();
        }
        let n = self.next_incarnation();
        for &r in ranks.iter().filter(|&&r| r < slices) {
            h.slice_incarnations[r as usize].store(n, Ordering::Release);
        }
        fence(Ordering::SeqCst);
        n
    }

    /// The incarnation `[offset, offset + len)` was handed out under: its slice's. CLOSED once
    /// the owner let go, and 0 (which is never handed out) for a range across two slices.
    pub fn incarnation_of(&self, offset: u64, len: usize) -> u32 {
        let h = self.header();
        let whole = h.incarnation.load(Ordering::Acquire);
        let slices = h.slices.load(Ordering::Acquire);
        if whole == CLOSED || slices == 0 {
            return whole;
        }
        if slices > MAX_SLICES {
            // The owner's memory says what no owner writes: no range is good.
            return 0;
        }
        let size = self.len as u64;
        let first = slice_rank(size, offset, slices);
        if len > 0 && slice_rank(size, offset.saturating_add(len as u64 - 1), slices) != first {
            return 0;
        }
        h.slice_incarnations[first as usize].load(Ordering::Acquire)
    }

    fn refuse_read_only(&self) -> Result<(), TransferError> {
        if self.writable {
            Ok(())
        } else {
            Err(TransferError::Remote(ErrorCode::CAPABILITY_INVALID))
        }
    }

    /// Before writing `[offset, offset + len)` of a range of generation `gen` handed out in
    /// `incarnation`: refuses if the segment was remounted since, then stamps the range's
    /// blocks with `gen`, then fences so that no byte written afterwards can be seen without
    /// the stamp.
    pub fn stamp(&self, offset: u64, len: usize, incarnation: u32, gen: u32) -> Result<(), TransferError> {
        self.stamp_with(offset, len, incarnation, gen, false)
    }

    /// [`stamp`](Self::stamp), with streaming stores when `streaming` is set (for a write
    /// large enough to stream its bytes too).
    pub fn stamp_with(
        &self,
        offset: u64,
        len: usize,
        incarnation: u32,
        gen: u32,
        streaming: bool,
    ) -> Result<(), TransferError> {
        self.check(offset, len)?;
        self.refuse_read_only()?;
        if len == 0 {
            return Ok(());
        }
        if self.incarnation_of(offset, len) != incarnation {
            return Err(TransferError::Remote(ErrorCode::RANGE_REUSED));
        }
        let (words, n) = self.gen_words(offset, len);
        let (pages, np) = self.summary_words(offset, len);
        // SAFETY: `n` and `np` aligned words of the generation area (the range was checked).
        // They are shared with other processes, as the data is; the fence below (a full one,
        // which also orders streaming stores) orders them before the data.
        unsafe {
            crate::copy::fill_u32(words, n, gen, streaming);
            crate::copy::fill_u32(pages, np, gen, false);
        }
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Retires the range of generation `gen` of `incarnation` after its value was replaced:
    /// every block that still carries `gen` gets 0, which no range is ever handed out with, so
    /// that a reader holding the old descriptor fails its check. Blocks already reused keep
    /// their new generation.
    pub fn retire(&self, offset: u64, len: usize, incarnation: u32, gen: u32) -> Result<(), TransferError> {
        self.check(offset, len)?;
        self.refuse_read_only()?;
        if len == 0 || self.incarnation_of(offset, len) != incarnation {
            return Ok(());
        }
        for g in self.gens(offset, len) {
            let _ = g.compare_exchange(gen, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
        let (pages, np) = self.summary_words(offset, len);
        for i in 0..np {
            // SAFETY: `i` < `np` words of the summary area (the range was checked); AtomicU32 has
            // the layout of u32.
            let word = unsafe { &*(pages.add(i) as *const AtomicU32) };
            let _ = word.compare_exchange(gen, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// After copying `[offset, offset + len)` out: whether every byte copied belonged to the
    /// range of generation `gen` of `incarnation` (nobody has started writing over it since).
    pub fn verify(&self, offset: u64, len: usize, incarnation: u32, gen: u32) -> Result<(), TransferError> {
        self.check(offset, len)?;
        // The copy's loads must happen before the loads of the stamps: an acquire fence (on
        // x86, which keeps loads in order, it costs nothing). Writers use a full fence, which
        // also orders their streaming stores.
        fence(Ordering::Acquire);
        // Pages wholly inside the range are checked by their summary, the rest block by block.
        let end = offset + len as u64;
        let first_full = offset.next_multiple_of(PAGE as u64);
        let end_full = end / PAGE as u64 * PAGE as u64;
        let changed = if len > 0 && first_full < end_full {
            let (pages, np) = self.summary_words(first_full, (end_full - first_full) as usize);
            self.blocks_differ(offset, (first_full - offset) as usize, gen)
                | words_differ(pages, np, gen)
                | self.blocks_differ(end_full, (end - end_full) as usize, gen)
        } else {
            self.blocks_differ(offset, len, gen)
        };
        if self.incarnation_of(offset, len) != incarnation || changed != 0 {
            return Err(TransferError::Remote(ErrorCode::RANGE_REUSED));
        }
        Ok(())
    }

    /// For a peer's segment: whether its owner still serves it (it has neither let go of the
    /// segment nor exited). Always true for this process's own segments.
    pub fn peer_still_open(&self) -> bool {
        match self.owner {
            None => true,
            Some((pid, started)) => self.incarnation() != CLOSED && start_time(pid) == Some(started),
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: creation refuses size 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte in this process.
    pub fn base(&self) -> u64 {
        self.ptr as u64
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, TransferError> {
        let off = usize::try_from(offset).map_err(|_| TransferError::out_of_range(offset, len, self.len))?;
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(off),
            _ => Err(TransferError::out_of_range(offset, len, self.len)),
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the mapping.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), TransferError> {
        self.read_with(offset, dst, false)
    }

    /// Copies `src` into the mapping at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), TransferError> {
        self.write_with(offset, src, false)
    }

    /// [`read`](Self::read), with streaming stores when `streaming` is set (see `copy`).
    pub fn read_with(&self, offset: u64, dst: &mut [u8], streaming: bool) -> Result<(), TransferError> {
        let off = self.check(offset, dst.len())?;
        // SAFETY: the range is inside the mapping (checked); dst is a distinct buffer.
        unsafe { crate::copy::copy(dst.as_mut_ptr(), self.ptr.add(off), dst.len(), streaming) };
        Ok(())
    }

    /// [`write`](Self::write), with streaming stores when `streaming` is set.
    pub fn write_with(&self, offset: u64, src: &[u8], streaming: bool) -> Result<(), TransferError> {
        let off = self.check(offset, src.len())?;
        self.refuse_read_only()?;
        // SAFETY: the range is inside the mapping (checked); src is a distinct buffer.
        unsafe { crate::copy::copy(self.ptr.add(off), src.as_ptr(), src.len(), streaming) };
        Ok(())
    }

    /// The bytes at `offset..offset + len`, for sending them over a socket.
    ///
    /// # Safety
    /// The caller must not hold the slice across a point where another party may write the
    /// same range; the store's protocol guarantees that for ranges handed out by the master.
    pub unsafe fn slice(&self, offset: u64, len: usize) -> Result<&[u8], TransferError> {
        let off = self.check(offset, len)?;
        // SAFETY: in bounds (checked); aliasing is the caller's contract above.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) })
    }

    /// Mutable view of `offset..offset + len`, for receiving from a socket.
    ///
    /// # Safety
    /// As for [`Mapping::slice`]: no one else may access the range meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: usize) -> Result<&mut [u8], TransferError> {
        let off = self.check(offset, len)?;
        self.refuse_read_only()?;
        // SAFETY: in bounds (checked); exclusivity is the caller's contract above.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) })
    }
}

/// Whether any of `n` words at `words` differs from `gen` (0 if none), in a scan the compiler
/// can vectorize.
fn words_differ(words: *const u32, n: usize, gen: u32) -> u32 {
    // SAFETY: callers pass words of the generation area of a checked range; they are shared
    // with other processes and read after the fence that follows the copy, like the data.
    (0..n).fold(0u32, |acc, i| acc | (unsafe { words.add(i).read() } ^ gen))
}

/// When process `pid` started (field 22 of `/proc/<pid>/stat`), to tell it from a later
/// process that got the same pid.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.owner.is_none() && self.writable {
            // The owner lets go: peers still mapping it see it closed, and drop it.
            self.header().incarnation.store(CLOSED, Ordering::Release);
        }
        // SAFETY: unmapping exactly what map() mapped.
        unsafe { libc::munmap(self.map as *mut libc::c_void, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_write_read_and_map_from_path() {
        let m = Mapping::create("t", 1 << 20).unwrap();
        m.write(100, b"hello").unwrap();
        let mut out = [0u8; 5];
        m.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        let peer = peer_of(&m, true);
        assert_eq!(peer.len(), 1 << 20);
        peer.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        peer.write(0, b"x").unwrap();
        let mut one = [0u8; 1];
        m.read(0, &mut one).unwrap();
        assert_eq!(&one, b"x");
        // A read-only peer reads, and refuses every kind of write.
        let reader = peer_of(&m, false);
        reader.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(reader.write(0, b"y").is_err());
        assert!(reader.stamp(0, 64, reader.incarnation(), 3).is_err());
        assert!(reader.retire(0, 64, reader.incarnation(), 3).is_err());
        // The memory cannot change size under its peers.
        // SAFETY: ftruncate on a valid fd; it must fail.
        assert_ne!(unsafe { libc::ftruncate(m.fd.as_raw_fd(), 4096) }, 0, "sealed against shrinking");
        // An owner that lets go is seen as gone.
        assert!(reader.peer_still_open());
        drop(m);
        assert!(!reader.peer_still_open());
    }

    #[test]
    fn a_stable_segments_incarnations_start_where_it_says_once() {
        let m = Mapping::create("t", 1 << 20).unwrap();
        assert!(!m.start_incarnations_at(0) && !m.start_incarnations_at(CLOSED));
        assert!(m.start_incarnations_at(1_700_000_000));
        assert_eq!(m.bump_incarnation(), 1_700_000_000);
        assert!(!m.start_incarnations_at(5), "memory mounted before keeps its counter");
        assert_eq!(m.bump_incarnation(), 1_700_000_001);
    }

    #[test]
    fn a_new_incarnation_of_some_slices_fails_only_their_ranges() {
        let size = 1usize << 20;
        let m = Mapping::create("slices", size).unwrap();
        let first = m.bump_incarnation();
        assert!(!m.set_slices(1) && !m.set_slices(MAX_SLICES + 1), "one group, or too many: no slices");
        assert!(m.set_slices(4));
        let quarter = (size / 4) as u64;
        // A range in each slice, written under the first incarnation.
        for rank in 0..4u64 {
            m.stamp(rank * quarter, 4096, first, 7).unwrap();
            m.verify(rank * quarter, 4096, first, 7).unwrap();
        }
        // Slices 1 and 3 start over (their primary expired the owner): only their ranges fail,
        // for readers and writers alike, and a peer's mapping sees the same.
        let peer = peer_of(&m, false);
        let next = m.bump_slices(&[1, 3]);
        assert!(next > first);
        for rank in 0..4u32 {
            let at = rank as u64 * quarter;
            let kept = rank % 2 == 0;
            assert_eq!(m.verify(at, 4096, first, 7).is_ok(), kept, "slice {rank}");
            assert_eq!(peer.verify(at, 4096, first, 7).is_ok(), kept, "slice {rank}, by a peer");
            assert_eq!(m.stamp(at, 4096, first, 8).is_ok(), kept, "slice {rank}");
            assert_eq!(m.slice_incarnation(rank), if kept { first } else { next });
        }
        m.stamp(quarter, 4096, next, 9).unwrap();
        m.verify(quarter, 4096, next, 9).unwrap();
        // A range across two slices belongs to neither.
        assert_eq!(m.incarnation_of(quarter - 64, 128), 0);
        assert!(m.verify(quarter - 64, 128, first, 7).is_err());
        // The whole segment starting over fails every slice; incarnations are never reused.
        let all = m.bump_incarnation();
        assert!(all > next);
        assert!((0..4).all(|r| m.slice_incarnation(r) == all));
        assert!(m.verify(0, 4096, first, 8).is_err());
        // An owner letting go closes every slice.
        drop(m);
        assert!(peer.verify(quarter, 4096, next, 9).is_err());
        assert!(!peer.peer_still_open());
    }

    #[test]
    fn a_read_overlapped_by_a_new_write_fails_and_a_remount_fails_old_ranges() {
        let m = Mapping::create("t", 3000).unwrap();
        let peer = peer_of(&m, true);
        assert_eq!(peer.len(), 3000);
        let inc = m.bump_incarnation();
        assert_eq!(peer.incarnation(), inc);
        // Object A: blocks 0..16 (1024 bytes) with generation 7.
        peer.stamp(0, 1024, inc, 7).unwrap();
        peer.write(0, &[1u8; 1024]).unwrap();
        let mut out = [0u8; 1024];
        m.read(0, &mut out).unwrap();
        m.verify(0, 1024, inc, 7).unwrap();
        // A freed A; a new write of generation 8 takes one block in the middle.
        m.stamp(512, 64, inc, 8).unwrap();
        assert!(matches!(m.verify(0, 1024, inc, 7), Err(TransferError::Remote(ErrorCode::RANGE_REUSED))));
        // Blocks it does not touch still verify (a partial read of A's first half).
        m.verify(0, 512, inc, 7).unwrap();
        // Within whole pages the page summary decides: a 64-byte value landing in the middle
        // of a page of a large value fails the large value's reader, and only it.
        let big = Mapping::create("t", 64 * 1024).unwrap();
        let bi = big.bump_incarnation();
        big.stamp(4096, 3 * 4096 - 100, bi, 20).unwrap();
        big.verify(4096, 3 * 4096 - 100, bi, 20).unwrap();
        big.stamp(2 * 4096 + 640, 64, bi, 21).unwrap();
        assert!(big.verify(4096, 3 * 4096 - 100, bi, 20).is_err());
        assert!(big.verify(2 * 4096, 4096, bi, 20).is_err(), "the summary of a whole page");
        big.verify(4096, 4096, bi, 20).unwrap();
        big.verify(3 * 4096, 4096 - 100, bi, 20).unwrap();
        big.verify(2 * 4096 + 640, 64, bi, 21).unwrap();
        // Retiring a range resets the summaries of its pages too.
        big.stamp(8 * 4096, 2 * 4096, bi, 30).unwrap();
        big.retire(8 * 4096, 2 * 4096, bi, 30).unwrap();
        assert!(big.verify(8 * 4096, 2 * 4096, bi, 30).is_err());
        // A remount makes every range of the old incarnation fail, and refuses old writers.
        let next = m.bump_incarnation();
        assert!(m.verify(0, 512, inc, 7).is_err());
        assert!(peer.stamp(0, 64, inc, 9).is_err());
        peer.stamp(0, 64, next, 9).unwrap();
        // Retiring touches only blocks that still carry the retired generation.
        m.stamp(0, 128, next, 10).unwrap();
        m.stamp(64, 64, next, 11).unwrap();
        m.retire(0, 128, next, 10).unwrap();
        assert!(m.verify(0, 64, next, 10).is_err());
        m.verify(64, 64, next, 11).unwrap();
        // The last, partial block is covered too.
        m.stamp(2990, 10, next, 5).unwrap();
        m.verify(2990, 10, next, 5).unwrap();
    }

    /// A peer's view of `m`, as the local socket would hand it over.
    fn peer_of(m: &Mapping, writable: bool) -> Mapping {
        Mapping::from_fd(m.fd_for_peer(writable).unwrap(), writable, std::process::id() as i32).unwrap()
    }

    #[test]
    fn memory_without_seals_or_a_generation_header_is_refused() {
        // SAFETY: plain libc calls on fds owned here.
        let unsealed = unsafe {
            let raw = libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC);
            assert!(raw >= 0);
            assert_eq!(libc::ftruncate(raw, 8192), 0);
            OwnedFd::from_raw_fd(raw)
        };
        let me = std::process::id() as i32;
        assert!(matches!(Mapping::from_fd(unsealed, false, me), Err(TransferError::InvalidRange(_))));
        // SAFETY: as above.
        let blank = unsafe {
            let raw = libc::memfd_create(c"y".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            assert_eq!(libc::ftruncate(raw, 8192), 0);
            assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, SEALS), 0);
            OwnedFd::from_raw_fd(raw)
        };
        assert!(matches!(Mapping::from_fd(blank, false, me), Err(TransferError::InvalidRange(_))));
    }

    #[test]
    fn a_segment_over_a_file_writes_into_the_file_and_is_never_shared() {
        use std::io::{Read, Seek, SeekFrom};
        let path = std::env::temp_dir().join(format!("tycho-over-file-{}", std::process::id()));
        let mut file =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(3 * PAGE as u64).unwrap();
        // Offsets off a page, and ranges past the file's end, are refused.
        assert!(matches!(Mapping::over_file("t", &file, 100, PAGE), Err(TransferError::InvalidRange(_))));
        assert!(matches!(Mapping::over_file("t", &file, PAGE as u64, 3 * PAGE), Err(TransferError::InvalidRange(_))));
        let m = Mapping::over_file("t", &file, PAGE as u64, 2 * PAGE - 10).unwrap();
        assert_eq!(m.len(), 2 * PAGE - 10);
        let next = m.bump_incarnation();
        m.stamp(5, 5, next, 7).unwrap();
        m.write(5, b"hello").unwrap();
        m.verify(5, 5, next, 7).unwrap();
        let mut back = [0u8; 5];
        file.seek(SeekFrom::Start(PAGE as u64 + 5)).unwrap();
        file.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"hello", "the bytes are in the file, at the offset given");
        assert!(!m.is_shareable());
        assert_eq!(m.fd_for_peer(false).unwrap_err().kind(), std::io::ErrorKind::Unsupported);
        assert_eq!(m.fd_for_peer(true).unwrap_err().kind(), std::io::ErrorKind::Unsupported);
        // The same bytes cannot become a second segment, even through another open of the file;
        // other bytes of it can, and the range is free again once the segment is gone.
        let again = std::fs::File::options()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .unwrap();
        assert!(matches!(Mapping::over_file("t", &again, PAGE as u64, PAGE), Err(TransferError::InvalidRange(_))));
        let first_page = Mapping::over_file("t", &again, 0, PAGE).unwrap();
        // The lock lives as long as the file stays open, by the segment or by whoever opened it.
        drop(m);
        drop(file);
        Mapping::over_file("t", &again, PAGE as u64, PAGE).unwrap();
        drop(first_page);
    }

    #[test]
    fn out_of_range_is_refused() {
        let m = Mapping::create("t", 4096).unwrap();
        let mut big = vec![0u8; 10];
        assert!(matches!(m.read(4090, &mut big), Err(TransferError::InvalidRange(_))));
        assert!(matches!(m.write(u64::MAX, b"a"), Err(TransferError::InvalidRange(_))));
        assert!(Mapping::create("t", 0).is_err());
    }
}
