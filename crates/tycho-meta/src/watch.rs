//! Watching a key or a prefix from a revision on.

use tokio::sync::mpsc;

use crate::error::{MetaError, MetaResult};
use crate::kv::{KeyValue, Revision};

/// What to watch and from where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchRequest {
    /// The key, or the prefix when `prefix` is set (an empty prefix watches every key).
    pub key: Vec<u8>,
    /// Watch every key starting with `key`.
    pub prefix: bool,
    /// First revision to report; 0 means "changes after now".
    pub start_revision: Revision,
}

impl WatchRequest {
    /// Changes to one key, from now on.
    pub fn key(key: impl Into<Vec<u8>>) -> WatchRequest {
        WatchRequest { key: key.into(), prefix: false, start_revision: 0 }
    }

    /// Changes to every key under `prefix`, from now on.
    pub fn prefix(prefix: impl Into<Vec<u8>>) -> WatchRequest {
        WatchRequest { key: prefix.into(), prefix: true, start_revision: 0 }
    }

    /// Starts at `revision` instead: every change at or after it is reported, including the
    /// ones that happened before the watch was created.
    pub fn from_revision(mut self, revision: Revision) -> WatchRequest {
        self.start_revision = revision;
        self
    }
}

/// One item of a watch, in revision order.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent {
    /// The key was written; the value and revisions after the write.
    Put(KeyValue),
    /// The key was deleted (or its lease ended); `mod_revision` is the delete's revision.
    Delete(KeyValue),
    /// The connection to the store broke. The watch reconnects by itself and resumes at
    /// `resume_from` (the revision after the last event delivered), so nothing is lost; until
    /// [`Resumed`](WatchEvent::Resumed) arrives the caller's view may be stale.
    Disconnected {
        /// Where the watch will resume.
        resume_from: Revision,
        /// Why it broke.
        error: MetaError,
    },
    /// The watch is connected again and continues from `resume_from`.
    Resumed {
        /// The first revision the resumed watch reports.
        resume_from: Revision,
    },
}

impl WatchEvent {
    /// The key-value of a `Put` or `Delete`.
    pub fn kv(&self) -> Option<&KeyValue> {
        match self {
            WatchEvent::Put(kv) | WatchEvent::Delete(kv) => Some(kv),
            _ => None,
        }
    }
}

/// A live watch. Dropping it cancels the watch.
///
/// [`next`](Watch::next) returns events until the watch ends with an error, which is final
/// and repeated by every later call: [`MetaError::Compacted`] when the history the watch needs
/// is gone (take a fresh snapshot and start a new watch from its revision + 1), or
/// [`MetaError::Closed`] when the store was dropped.
#[derive(Debug)]
pub struct Watch {
    rx: mpsc::Receiver<MetaResult<WatchEvent>>,
    ended: Option<MetaError>,
}

/// The producing side of a [`Watch`].
pub(crate) type WatchSender = mpsc::Sender<MetaResult<WatchEvent>>;

/// Events buffered between a watch's producer and its consumer.
const WATCH_BUFFER: usize = 256;

impl Watch {
    pub(crate) fn channel() -> (WatchSender, Watch) {
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        (tx, Watch { rx, ended: None })
    }

    /// The next event, or the error that ended the watch.
    pub async fn next(&mut self) -> MetaResult<WatchEvent> {
        if let Some(e) = &self.ended {
            return Err(e.clone());
        }
        let item = self.rx.recv().await.unwrap_or(Err(MetaError::Closed));
        if let Err(e) = &item {
            self.ended = Some(e.clone());
        }
        item
    }
}
