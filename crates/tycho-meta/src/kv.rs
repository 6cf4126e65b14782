//! Keys, values and the revisions that order every change.

/// A position in the store's single history. Every write that changes something advances it
/// by one; all changes made by one transaction share one revision. Starts at 1 in an empty
/// store; 0 means "none" or "now", depending on the call.
pub type Revision = i64;

/// A lease's id, as the store assigned it.
pub type LeaseId = i64;

/// One key with its value and the revisions that describe its history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// Revision of the write that created the key (since it was last absent).
    pub create_revision: Revision,
    /// Revision of the last write to the key (for a delete event: the delete's revision).
    pub mod_revision: Revision,
    /// Number of writes since creation: 1 after the create, 0 for a deleted key.
    pub version: i64,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// A single key read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetResponse {
    /// The key, or `None` if it does not exist.
    pub kv: Option<KeyValue>,
    /// The store's revision at which the read was served.
    pub revision: Revision,
}

/// A delete's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeleteResponse {
    /// Whether the key existed (and so was deleted).
    pub deleted: bool,
    /// The store's revision after the call (unchanged if nothing was deleted).
    pub revision: Revision,
}

/// One page of a prefix scan. Pages of one scan are all read at the same revision, so the scan
/// is a consistent snapshot even while writes continue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeRequest {
    /// Keys starting with these bytes; empty means every key.
    pub prefix: Vec<u8>,
    /// Continue from this key (inclusive); `None` starts at the prefix.
    pub start: Option<Vec<u8>>,
    /// At most this many keys per page; 0 means no limit.
    pub limit: usize,
    /// Read at this revision; `None` reads at the current one (and the page reports which).
    pub revision: Option<Revision>,
    /// Return keys and revisions only: every value comes back empty.
    pub keys_only: bool,
}

impl RangeRequest {
    /// The first page of every key under `prefix`, at most `limit` keys, at the current revision.
    pub fn prefix(prefix: impl Into<Vec<u8>>, limit: usize) -> RangeRequest {
        RangeRequest { prefix: prefix.into(), start: None, limit, revision: None, keys_only: false }
    }

    /// The same scan at a fixed revision.
    pub fn at_revision(mut self, revision: Revision) -> RangeRequest {
        self.revision = Some(revision);
        self
    }

    /// The same scan returning keys only.
    pub fn keys_only(mut self) -> RangeRequest {
        self.keys_only = true;
        self
    }

    /// The request for the page after `page`, or `None` if `page` was the last one.
    pub fn next_page(&self, page: &RangePage) -> Option<RangeRequest> {
        page.next.as_ref().map(|next| RangeRequest {
            prefix: self.prefix.clone(),
            start: Some(next.clone()),
            limit: self.limit,
            revision: Some(page.revision),
            keys_only: self.keys_only,
        })
    }

    /// The first key of the scan (inclusive).
    pub(crate) fn start_key(&self) -> Vec<u8> {
        match &self.start {
            Some(start) => start.clone(),
            // etcd reads an empty key with range end "\0" as "every key".
            None if self.prefix.is_empty() => vec![0],
            None => self.prefix.clone(),
        }
    }

    /// The end of the scan (exclusive); `[0]` means "to the last key", as in etcd.
    pub(crate) fn end_key(&self) -> Vec<u8> {
        prefix_end(&self.prefix)
    }
}

/// A page of keys, in key order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangePage {
    /// The keys of this page.
    pub kvs: Vec<KeyValue>,
    /// The revision the page was read at; later pages of the scan must use it.
    pub revision: Revision,
    /// The key to continue from, if more keys follow.
    pub next: Option<Vec<u8>>,
}

// Defined with the cluster key layout in tycho-proto, which clients read too.
pub use tycho_proto::cluster::prefix_end;

/// The smallest key greater than `key`: the continuation point after it.
pub(crate) fn key_after(key: &[u8]) -> Vec<u8> {
    let mut next = Vec::with_capacity(key.len() + 1);
    next.extend_from_slice(key);
    next.push(0);
    next
}

/// Whether `key` lies in `[start, end)`, where an `end` of `[0]` means unbounded.
pub(crate) fn in_range(key: &[u8], start: &[u8], end: &[u8]) -> bool {
    key >= start && (end == [0] || key < end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_that_can_be() {
        assert_eq!(prefix_end(b"a/"), b"a0".to_vec());
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(prefix_end(&[0xff, 0xff]), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn range_bounds() {
        assert!(in_range(b"a/x", b"a/", &prefix_end(b"a/")));
        assert!(!in_range(b"a0", b"a/", &prefix_end(b"a/")));
        assert!(in_range(b"zzz", &[0], &[0]));
        assert_eq!(key_after(b"k"), b"k\0".to_vec());
    }
}
