//! Memory that segments are made of: anonymous shared memory (memfd) mapped into this
//! process, and mappings of other processes' segments on the same host.
//!
//! A segment's memory is a memfd, so it disappears with its last user: no file is left in
//! `/dev/shm` when a process dies. Peers on the same host open it through
//! `/proc/<pid>/fd/<fd>` and map it, then copy with one `memcpy`.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::TransferError;

/// A mapped region, owned or borrowed from a peer.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// For a peer's segment: the path it was opened by and the file's identity then.
    peer: Option<(String, (u64, u64))>,
    // Keeps the memfd open for as long as peers may open it by path.
    fd: OwnedFd,
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
        if len == 0 {
            return Err(TransferError::InvalidRange("segment size must be positive".into()));
        }
        let cname = CString::new(name).map_err(|_| TransferError::InvalidRange("bad segment name".into()))?;
        // SAFETY: memfd_create takes a valid C string and flags; it returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(TransferError::Io(std::io::Error::last_os_error()));
        }
        // SAFETY: raw is a freshly created fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on an owned fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(TransferError::Io(std::io::Error::last_os_error()));
        }
        Self::map(fd, len)
    }

    /// Maps a peer's segment through its `/proc/<pid>/fd/<fd>` path.
    pub fn open(path: &str, len: usize) -> Result<Mapping, TransferError> {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
        let meta = file.metadata()?;
        let actual = meta.len() as usize;
        if actual < len {
            return Err(TransferError::InvalidRange(format!("{path} holds {actual} bytes, expected {len}")));
        }
        use std::os::unix::fs::MetadataExt;
        let identity = (meta.dev(), meta.ino());
        let mut m = Self::map(OwnedFd::from(file), len)?;
        m.peer = Some((path.to_string(), identity));
        Ok(m)
    }

    /// Maps `len` bytes of `fd`, pre-faulted: otherwise the first copy into each page pays a
    /// page fault, which can cost as much as the copy itself.
    fn map(fd: OwnedFd, len: usize) -> Result<Mapping, TransferError> {
        let flags = libc::MAP_SHARED | libc::MAP_POPULATE;
        // SAFETY: mapping a valid fd of at least `len` bytes; the result is checked.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd.as_raw_fd(), 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(TransferError::Io(std::io::Error::last_os_error()));
        }
        Ok(Mapping { ptr: ptr as *mut u8, len, peer: None, fd })
    }

    /// For a peer's segment: whether its path still names the memory mapped here (the owner
    /// has not closed it). Always true for this process's own segments.
    pub fn peer_still_open(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        match &self.peer {
            None => true,
            Some((path, id)) => std::fs::metadata(path).is_ok_and(|m| (m.dev(), m.ino()) == *id),
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

    /// The path a same-host peer opens to map this memory.
    pub fn peer_path(&self) -> String {
        format!("/proc/{}/fd/{}", std::process::id(), self.fd.as_raw_fd())
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
        // SAFETY: in bounds (checked); exclusivity is the caller's contract above.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what map() mapped.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
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
        let peer = Mapping::open(&m.peer_path(), 1 << 20).unwrap();
        peer.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        peer.write(0, b"x").unwrap();
        let mut one = [0u8; 1];
        m.read(0, &mut one).unwrap();
        assert_eq!(&one, b"x");
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
