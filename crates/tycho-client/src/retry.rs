//! The routing contract: what a client does with each error's retry class.

use std::time::Duration;

use tycho_proto::{ErrorCode, Redirect, Request, Response, RetryClass};
use tycho_rpc::BlockingClient;

/// Attempts per call, the first included.
pub const MAX_ATTEMPTS: u32 = 4;
/// Attempts at the same master after a lost connection or a timeout: one more, then the
/// caller refreshes its route (spec 03: a bounded retry of the same target, then a refresh).
pub const TRANSPORT_ATTEMPTS: u32 = 2;

/// How long one try of a call may take at one master.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Patience {
    /// For the connection, the greeting and the answer's first byte.
    pub first_byte: Duration,
    /// For the whole call.
    pub whole: Duration,
}

impl Patience {
    /// One deadline for everything.
    pub fn whole(t: Duration) -> Patience {
        Patience { first_byte: t, whole: t }
    }
}
/// First back-off for transient errors; doubles per attempt.
const BACKOFF: Duration = Duration::from_millis(20);

/// Whether repeating `req` after an unknown outcome is harmless. Write starts, ends and
/// revokes name their write by id: a repeated start gets the same ranges back, a repeated end
/// or revoke finds its work done; so do a task's copy steps.
pub fn is_idempotent(req: &Request) -> bool {
    !matches!(
        req,
        Request::Remove(_)
            | Request::BatchRemove(_)
            | Request::RemoveByRegex { .. }
            | Request::RemoveAll { .. }
            | Request::BatchReplicaClear(_)
            // A second task, or tasks handed out twice (a lost answer leaves them running until
            // their timeout).
            | Request::CreateTask(_)
            | Request::FetchTasks { .. }
            // Its fresh slices are fresh once: sent again, the master could meanwhile have
            // dropped what the first one mounted (the next offer says they are not fresh).
            | Request::MountSlices { .. }
    )
}

/// Calls the master, retrying as each error's retry class says, within [`MAX_ATTEMPTS`].
/// A transport error (the outcome is unknown) is retried only for idempotent requests.
pub fn call_with_retry(master: &BlockingClient, req: &Request, timeout: Duration) -> Result<Response, ErrorCode> {
    call_noting(master, req, Patience::whole(timeout), |_| {})
}

/// As [`call_with_retry`], each try within `patience`.
pub fn call_patiently(master: &BlockingClient, req: &Request, patience: Patience) -> Result<Response, ErrorCode> {
    call_noting(master, req, patience, |_| {})
}

/// As [`call_with_retry`]; a refusal that names the group's primary (KVPT_NOT_OWNED with a
/// [`Redirect`]) is shown to `redirected` before it is returned as KVPT_NOT_OWNED.
pub fn call_noting(
    master: &BlockingClient,
    req: &Request,
    patience: Patience,
    redirected: impl Fn(&Redirect),
) -> Result<Response, ErrorCode> {
    let mut attempt = 1;
    loop {
        let (code, transport) = match master.call_within::<Request, Response>(req, patience.first_byte, patience.whole)
        {
            Ok(Response::Error(code)) => (code, false),
            Ok(Response::NotOwned(r)) => {
                redirected(&r);
                (ErrorCode::KVPT_NOT_OWNED, false)
            }
            // A batch whose refused keys' owners are named: noted, and the answer is the batch's.
            Ok(Response::Redirected { answer, owners }) => {
                owners.iter().for_each(&redirected);
                return Ok(*answer);
            }
            Ok(resp) => return Ok(resp),
            Err(e) => (e.code(), true),
        };
        let retry = match code.retry_class() {
            RetryClass::Fail => false,
            // The same request would meet the same route: the caller refreshes it (see the
            // client's `call`).
            RetryClass::RefreshRoute => false,
            // Another master may own it: the caller moves on (see the client's `call`).
            RetryClass::Redirect => false,
            RetryClass::RetrySame => !transport || is_idempotent(req),
        };
        let most = if transport { TRANSPORT_ATTEMPTS } else { MAX_ATTEMPTS };
        if !retry || attempt >= most {
            return Err(code);
        }
        if code.retry_class() == RetryClass::RetrySame {
            std::thread::sleep(BACKOFF * 2u32.pow(attempt - 1));
        }
        attempt += 1;
    }
}
