//! Every gRPC status the service sends, built here and nowhere else, so a code means one thing
//! across the gateway and the pools (and matches what `video.proto` documents):
//!
//! | code | when |
//! |---|---|
//! | INVALID_ARGUMENT | the request breaks a limit (names the field, the value and the rule) |
//! | UNAUTHENTICATED | an API key is required and missing, malformed or unknown |
//! | NOT_FOUND | `Cancel` of a request that is not queued or running for this key (another key's looks the same) |
//! | PERMISSION_DENIED | a pool's registration names an address its certificate does not, or another pool's id |
//! | RESOURCE_EXHAUSTED | the queue is full; this key's queue share is used; the request's estimated cost exceeds the devices; a pool is busy |
//! | CANCELLED | `Cancel`, the client went away, or it read nothing for the send timeout |
//! | DEADLINE_EXCEEDED | the request's deadline passed, queued or running; or its request message did not arrive in full within `connections.request_timeout_s` |
//! | UNAVAILABLE | shutting down; a pool was lost mid-request, out of service, or unreachable |
//! | ALREADY_EXISTS | a pool is asked twice for one request |
//! | FAILED_PRECONDITION | a pool registers for another model |
//! | INTERNAL | a model, encoder or link failed; the message says where |

use std::time::Duration;

use tonic::{Code, Status};

#[cfg(test)]
#[test]
fn code_names_are_snake_case() {
    assert_eq!(code_name(Code::ResourceExhausted), "resource_exhausted");
    assert_eq!(code_name(Code::Cancelled), "cancelled");
}

/// A string the client sent, as an error message shows it: quoted, and cut to its first 64
/// characters (with its length) when longer, so echoing it keeps the message readable and the
/// `grpc-message` trailer small (gRPC clients cap metadata at 8–16 KiB).
pub fn shown(value: &str) -> String {
    const MAX_CHARS: usize = 64;
    match value.char_indices().nth(MAX_CHARS) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &value[..cut], value.len()),
    }
}

#[cfg(test)]
#[test]
fn long_client_strings_are_cut_when_shown() {
    assert_eq!(shown("tiny"), "\"tiny\"");
    let long = "é".repeat(100_000);
    let s = shown(&long);
    assert_eq!(s, format!("{:?}… (200000 bytes)", "é".repeat(64)));
}

/// A code as a stable lower-case name (`ResourceExhausted` → `resource_exhausted`), for
/// metric labels and the HTTP API's error codes.
pub fn code_name(code: Code) -> String {
    let mut out = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The request breaks a limit (`e` names the field, the value and the rule).
pub fn invalid(e: &impl std::fmt::Display) -> Status {
    Status::invalid_argument(e.to_string())
}

/// An internal request field is out of range (a pool checking what the gateway sent).
pub fn invalid_field(field: &str, value: impl std::fmt::Display, rule: &str) -> Status {
    Status::invalid_argument(format!("{field} = {value}: {rule}"))
}

/// The request needs more than the serving devices have (`e` names the estimate and the limit).
pub fn over_budget(e: &impl std::fmt::Display) -> Status {
    Status::resource_exhausted(e.to_string())
}

/// No API key, or one this server does not know.
pub fn unauthenticated(why: &str) -> Status {
    Status::unauthenticated(why)
}

/// `id` is not a request of the caller's key that is queued or running: it never existed, it
/// ended, or another key made it (the three answer alike).
pub fn no_such_request(id: &str) -> Status {
    Status::not_found(format!(
        "no request {} of this API key is queued or running",
        shown(id)
    ))
}

/// A control-plane peer asked for something its certificate does not cover.
pub fn permission_denied(why: impl std::fmt::Display) -> Status {
    Status::permission_denied(why.to_string())
}

/// Admission refused: the key `principal` already has `limit` requests waiting.
pub fn key_queue_full(principal: &str, limit: usize) -> Status {
    Status::resource_exhausted(format!(
        "serving.per_key.max_queued = {limit}: API key {principal:?} already has {limit} requests \
         waiting; retry when one has started"
    ))
}

/// Admission refused: `depth` requests wait already.
pub fn queue_full(depth: usize) -> Status {
    Status::resource_exhausted(format!(
        "the queue is full ({depth} requests waiting, serving.queue_depth); retry later"
    ))
}

/// A pool asked for a second request while it runs one.
pub fn pool_busy(what: &str) -> Status {
    Status::resource_exhausted(format!("this {what} is running another request"))
}

/// The server stops admitting.
pub fn shutting_down() -> Status {
    Status::unavailable("the server is shutting down")
}

/// `Cancel` named the request.
pub fn cancelled() -> Status {
    Status::cancelled("the request was cancelled")
}

/// The client closed its stream.
pub fn client_gone() -> Status {
    Status::cancelled("the client went away")
}

/// The client left its stream unread for the send timeout.
pub fn client_stalled(timeout: Duration) -> Status {
    Status::cancelled(format!(
        "the client read nothing for {:.1} s (serving.client_send_timeout_s): its request was dropped",
        timeout.as_secs_f64()
    ))
}

/// The deadline passed.
pub fn deadline() -> Status {
    Status::deadline_exceeded("the request's deadline passed")
}

/// The client's request (message or HTTP body) did not arrive in full within `timeout` of
/// its headers.
pub fn request_too_slow(timeout: Duration) -> Status {
    Status::deadline_exceeded(format!(
        "the request did not arrive in full within {:.1} s (connections.request_timeout_s)",
        timeout.as_secs_f64()
    ))
}

/// A pool cannot serve at all (a rank thread of its stage is gone).
pub fn out_of_service(what: &str, why: &str) -> Status {
    Status::unavailable(format!("this {what} is out of service: {why}"))
}

/// A pool could not be reached or answered with a transport failure.
pub fn unreachable(what: &str, address: &str, why: impl std::fmt::Display) -> Status {
    Status::unavailable(format!("{what} at {address} is unreachable: {why}"))
}

/// What a client sees when a pool's stream fails mid-request: transport failures (the process
/// died, the connection broke; tonic reports those as UNKNOWN, UNAVAILABLE or CANCELLED) become
/// UNAVAILABLE naming the pool and the reason; a pool's own documented answer passes through.
pub fn from_pool(what: &str, address: &str, status: Status) -> Status {
    if is_transport_failure(&status) {
        Status::unavailable(format!(
            "{what} at {address} was lost mid-request: {}",
            status.message()
        ))
    } else {
        status
    }
}

/// Whether a pool's stream failed in transport (the process or the connection went) rather
/// than with one of the pool's own answers: only then is the pool dropped from the registry.
pub fn is_transport_failure(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unknown | Code::Unavailable | Code::Cancelled | Code::Aborted
    )
}

/// A pool's stream ended without the event that finishes its part.
pub fn pool_ended(what: &str, address: &str, missing: &str) -> Status {
    Status::unavailable(format!(
        "{what} at {address} ended its stream before {missing}"
    ))
}

/// Whether a failure to start work on a pool means the pool is gone (route the request to
/// another) rather than a refusal of this request.
pub fn is_unreachable(status: &Status) -> bool {
    matches!(status.code(), Code::Unknown | Code::Unavailable)
}

/// A pool is asked twice for one request.
pub fn duplicate(id: &str) -> Status {
    Status::already_exists(format!("request {id} is already decoding here"))
}

/// A pool registers for another model.
pub fn wrong_model(sent: &str, served: &str) -> Status {
    Status::failed_precondition(format!(
        "model = {}: this gateway serves {served:?}",
        shown(sent)
    ))
}

/// A stage or link failed; `what` says where.
pub fn internal(what: &str, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what}: {e}"))
}
