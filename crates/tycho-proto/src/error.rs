//! Stable error codes and the retry class each one belongs to.
//!
//! The numbers of codes Mooncake Store also has are Mooncake's, so that a Python caller
//! that checks for `-706` keeps working. Routing codes are new and live in the `-2000` block,
//! which Mooncake does not use.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What a client does when it receives an error code. Decided once per code, here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryClass {
    /// The target no longer owns the key; retry at once on the owner it names.
    Redirect,
    /// The client's route or epoch is old; refresh the route, then retry.
    RefreshRoute,
    /// Transient on the same target (busy, migrating, transport); back off and retry there.
    RetrySame,
    /// Final: retrying cannot change the answer.
    Fail,
}

macro_rules! error_codes {
    ($( $(#[$doc:meta])* $name:ident = $num:expr, $class:ident; )*) => {
        /// A typed error as it travels on the wire: a stable `i32`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[repr(i32)]
        #[allow(non_camel_case_types)]
        pub enum ErrorCode {
            $( $(#[$doc])* $name = $num, )*
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$name,)*];

            /// The code for a wire number, if it is one Tycho knows.
            pub fn from_i32(n: i32) -> Option<ErrorCode> {
                match n {
                    $( $num => Some(ErrorCode::$name), )*
                    _ => None,
                }
            }

            /// The upper-case name, as logs and the CLI print it.
            pub fn name(self) -> &'static str {
                match self {
                    $( ErrorCode::$name => stringify!($name), )*
                }
            }

            /// How a client reacts to this code.
            pub fn retry_class(self) -> RetryClass {
                match self {
                    $( ErrorCode::$name => RetryClass::$class, )*
                }
            }
        }
    };
}

error_codes! {
    /// Unexpected failure inside the server.
    INTERNAL_ERROR = -1, Fail;
    /// A buffer was too small for the data.
    BUFFER_OVERFLOW = -10, Fail;
    /// A shard index was outside the shard table.
    SHARD_INDEX_OUT_OF_RANGE = -100, Fail;
    /// The segment is not mounted.
    SEGMENT_NOT_FOUND = -101, Fail;
    /// A different segment with this identity or range is already mounted.
    SEGMENT_ALREADY_EXISTS = -102, Fail;
    /// The client id is unknown to the master.
    CLIENT_NOT_FOUND = -103, Fail;
    /// No segment has room for the requested size.
    NO_AVAILABLE_HANDLE = -200, Fail;
    /// Version mismatch.
    INVALID_VERSION = -300, Fail;
    /// The key is empty, too long or otherwise unusable.
    INVALID_KEY = -400, Fail;
    /// Writing the bytes failed.
    WRITE_FAIL = -500, Fail;
    /// A parameter is out of range or inconsistent.
    INVALID_PARAMS = -600, Fail;
    /// The caller is not the client this operation belongs to.
    ILLEGAL_CLIENT = -601, Fail;
    /// The write is not allowed in the object's current state.
    INVALID_WRITE = -700, Fail;
    /// The read is not allowed in the object's current state.
    INVALID_READ = -701, Fail;
    /// The replica is not usable.
    INVALID_REPLICA = -702, Fail;
    /// The object is still being written.
    REPLICA_IS_NOT_READY = -703, Fail;
    /// No such object.
    OBJECT_NOT_FOUND = -704, Fail;
    /// The object exists already (put is put-if-absent).
    OBJECT_ALREADY_EXISTS = -705, Fail;
    /// The object holds a read lease and cannot be removed or replaced now.
    OBJECT_HAS_LEASE = -706, Fail;
    /// The read lease ran out before the read finished.
    LEASE_EXPIRED = -707, Fail;
    /// The object has a replication task in flight.
    OBJECT_HAS_REPLICATION_TASK = -708, Fail;
    /// The object has no replication task.
    OBJECT_NO_REPLICATION_TASK = -709, Fail;
    /// No such replica.
    REPLICA_NOT_FOUND = -710, Fail;
    /// The replica exists already.
    REPLICA_ALREADY_EXISTS = -711, Fail;
    /// The replica was removed.
    REPLICA_IS_GONE = -712, Fail;
    /// The replica is not in local memory.
    REPLICA_NOT_IN_LOCAL_MEMORY = -713, Fail;
    /// The object's replicas are busy.
    OBJECT_REPLICA_BUSY = -714, RetrySame;
    /// Moving bytes between hosts failed.
    TRANSFER_FAIL = -800, RetrySame;
    /// The bytes read do not match their checksum.
    CHECKSUM_MISMATCH = -801, Fail;
    /// The RPC could not be delivered or its connection broke.
    RPC_FAIL = -900, RetrySame;
    /// The RPC did not complete before its deadline.
    RPC_TIMEOUT = -901, RetrySame;
    /// The coordinator refused or failed an operation.
    ETCD_OPERATION_ERROR = -1000, RetrySame;
    /// The coordinator key does not exist.
    ETCD_KEY_NOT_EXIST = -1001, Fail;
    /// A coordinator transaction's compare failed.
    ETCD_TRANSACTION_FAIL = -1002, Fail;
    /// A coordinator call was cancelled.
    ETCD_CTX_CANCELLED = -1003, RetrySame;
    /// The OpLog entry does not exist.
    OPLOG_ENTRY_NOT_FOUND = -1004, Fail;
    /// The standby has not caught up with the OpLog.
    INCOMPLETE_OPLOG_CATCH_UP = -1007, RetrySame;
    /// The service cannot do this in its current status (for example a standby).
    UNAVAILABLE_IN_CURRENT_STATUS = -1010, RetrySame;
    /// The service cannot do this in its current mode.
    UNAVAILABLE_IN_CURRENT_MODE = -1011, Fail;
    /// The operation is not supported.
    NOT_SUPPORTED = -1012, Fail;
    /// No such task.
    TASK_NOT_FOUND = -1400, Fail;
    /// Too many pending tasks.
    TASK_PENDING_LIMIT_EXCEEDED = -1401, RetrySame;
    /// The tenant's quota is exhausted.
    TENANT_QUOTA_EXCEEDED = -1700, Fail;
    /// This master does not own the key's KVPT group; the reply names the owner when known.
    KVPT_NOT_OWNED = -2000, Redirect;
    /// The KVPT group is moving; writes are frozen for a bounded time.
    KVPT_MIGRATING = -2001, RetrySame;
    /// The request carried an epoch older than the group's current one.
    STALE_EPOCH = -2002, RefreshRoute;
    /// The request's route does not match the key or the current ownership.
    STALE_ROUTE = -2003, RefreshRoute;
    /// A VSegment is being created for this partition.
    VSEGMENT_CREATING = -2004, RetrySame;
    /// The partition's static VSegment quota cannot hold the layout.
    VSEGMENT_STATIC_QUOTA_INSUFFICIENT = -2005, Fail;
    /// The write named was not committed and never will be: it was pre-empted, reclaimed, or
    /// every segment it wrote to went away. Nothing of it is visible.
    WRITE_DROPPED = -2100, Fail;
    /// The range being read was freed and handed to another write while it was copied: the
    /// bytes are not the object's. Read again with fresh metadata.
    RANGE_REUSED = -2101, RetrySame;
    /// The client has as many unfinished writes as the master allows one client.
    TOO_MANY_PENDING_WRITES = -2102, Fail;
    /// The server requires the cluster secret and the caller did not present it.
    AUTH_REQUIRED = -2200, Fail;
    /// The caller's proof of the cluster secret or of its client credential is wrong.
    AUTH_FAILED = -2201, Fail;
    /// A data-path request carried no valid capability for the range it names.
    CAPABILITY_INVALID = -2202, Fail;
    /// The capability was valid but has expired; ask the master again.
    CAPABILITY_EXPIRED = -2203, RetrySame;
    /// The caller's role or tenant does not allow this operation.
    PERMISSION_DENIED = -2204, Fail;
    /// The master runs as many key scans (listings, removal by pattern) as it allows at once.
    SCANS_BUSY = -2205, RetrySame;
    /// A batch names more keys than one request may carry.
    BATCH_TOO_LARGE = -2206, Fail;
    /// A configured cap is reached (segment size, segments per client).
    RESOURCE_LIMIT = -2207, Fail;
    /// The node serves payloads encrypted only, and the request asked for them in the clear.
    ENCRYPTION_REQUIRED = -2208, Fail;
    /// The peers' clocks are further apart than held ranges allow (`CLOCK_SKEW_MS`).
    CLOCK_SKEW = -2209, Fail;
}

impl ErrorCode {
    /// The wire number.
    pub fn as_i32(self) -> i32 {
        self as i32
    }

    /// A short hint for a person reading the error.
    pub fn hint(self) -> &'static str {
        use ErrorCode::*;
        match self {
            OBJECT_NOT_FOUND => "no object has this key; check the key and tenant",
            OBJECT_ALREADY_EXISTS => "put never overwrites; use upsert to replace the value",
            OBJECT_HAS_LEASE => "a reader holds a lease; retry after the lease TTL or force the removal",
            NO_AVAILABLE_HANDLE => "no mounted segment has room; mount more memory or remove objects",
            INVALID_KEY => "keys must be non-empty and at most 4096 bytes, tenants at most 255 bytes",
            INVALID_PARAMS => "a parameter is out of range; see the message and the docs",
            CLIENT_NOT_FOUND => "the master does not know this client; it must mount a segment first",
            SEGMENT_NOT_FOUND => "the segment is not mounted on this master",
            SEGMENT_ALREADY_EXISTS => "a segment with this id or an overlapping range is mounted",
            ILLEGAL_CLIENT => "only the client that started the write may end or revoke it",
            REPLICA_IS_NOT_READY => "the object is still being written; try again once its writer has finished",
            LEASE_EXPIRED => "the read outlived its lease; read again",
            RPC_FAIL | RPC_TIMEOUT => "the master did not answer; check that it runs and the address",
            KVPT_NOT_OWNED | STALE_EPOCH | STALE_ROUTE => "the route is stale; the client refreshes it",
            KVPT_MIGRATING => "the key's group is moving; retry after a short back-off",
            WRITE_DROPPED => {
                "the write was dropped before it committed (pre-empted, timed out, or its memory left); write again"
            }
            RANGE_REUSED => "the object was replaced or removed while it was read; read it again",
            TOO_MANY_PENDING_WRITES => "finish (end or revoke) some of this client's writes before starting more",
            AUTH_REQUIRED => "give this process the cluster secret: TYCHO_SECRET_FILE=<path> (see docs/security.md)",
            AUTH_FAILED => {
                "the cluster secret differs from the server's; give every process of the cluster the same one"
            }
            CAPABILITY_INVALID => "the range was not granted to this caller; ask the master for the object again",
            CAPABILITY_EXPIRED => "the grant ran out before the transfer; ask the master again",
            PERMISSION_DENIED => "this operation needs the owner of the resource or the admin role",
            SCANS_BUSY => "other key scans are running; retry shortly",
            BATCH_TOO_LARGE => "split the batch; the client library does this by itself",
            RESOURCE_LIMIT => "a configured cap is reached: see --max-segment-size and --max-segments-per-client",
            ENCRYPTION_REQUIRED => {
                "the node encrypts payloads (tycho node --encrypt); set TYCHO_ENCRYPT=1 on this client"
            }
            CLOCK_SKEW => "the hosts' clocks are more than 5 s apart; synchronize them (NTP)",
            _ => "see docs/errors.md",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.as_i32())
    }
}

impl std::error::Error for ErrorCode {}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i32(self.as_i32())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i32::deserialize(d)?;
        ErrorCode::from_i32(n).ok_or_else(|| serde::de::Error::custom(format_args!("unknown error code {n}")))
    }
}

/// Result type of every fallible wire operation.
pub type WireResult<T> = Result<T, ErrorCode>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_unique_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for &c in ErrorCode::ALL {
            assert!(seen.insert(c.as_i32()), "duplicate number {}", c.as_i32());
            assert_eq!(ErrorCode::from_i32(c.as_i32()), Some(c));
        }
        assert_eq!(ErrorCode::from_i32(12345), None);
    }

    #[test]
    fn mooncake_numbers_hold() {
        assert_eq!(ErrorCode::OBJECT_NOT_FOUND.as_i32(), -704);
        assert_eq!(ErrorCode::OBJECT_HAS_LEASE.as_i32(), -706);
        assert_eq!(ErrorCode::NO_AVAILABLE_HANDLE.as_i32(), -200);
        assert_eq!(ErrorCode::INVALID_PARAMS.as_i32(), -600);
        assert_eq!(ErrorCode::TENANT_QUOTA_EXCEEDED.as_i32(), -1700);
    }

    #[test]
    fn routing_codes_have_their_classes() {
        assert_eq!(ErrorCode::KVPT_NOT_OWNED.retry_class(), RetryClass::Redirect);
        assert_eq!(ErrorCode::STALE_EPOCH.retry_class(), RetryClass::RefreshRoute);
        assert_eq!(ErrorCode::STALE_ROUTE.retry_class(), RetryClass::RefreshRoute);
        assert_eq!(ErrorCode::KVPT_MIGRATING.retry_class(), RetryClass::RetrySame);
        assert_eq!(ErrorCode::OBJECT_NOT_FOUND.retry_class(), RetryClass::Fail);
    }

    #[test]
    fn unknown_wire_number_is_a_decode_error() {
        let bytes = postcard::to_stdvec(&-31337i32).unwrap();
        assert!(postcard::from_bytes::<ErrorCode>(&bytes).is_err());
    }
}
