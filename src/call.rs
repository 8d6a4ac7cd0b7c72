//! One subscriber call, as values: which call of a delivery it is ([`Leg`]), and how it ended
//! ([`Failure`], from [`classify`]ing Envoy's answer). The bottom of the module map: the
//! retry policy, replies, dead letters, metrics and the fan-out state all speak of calls in
//! these terms, and this module needs none of them.

use crate::answer::sanitize;

/// How much of a failed subscriber's answer the report quotes (a dead letter carries up to
/// [`BODY_PEEK_BYTES`]).
pub const DETAIL_BYTES: usize = 256;
/// How much of a failed subscriber's answer is read to classify it.
pub const BODY_PEEK_BYTES: usize = 1024;

/// Why a subscriber did not take the event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// It answered with a status other than 2xx.
    Status { status: u16, detail: String },
    /// No answer within the subscriber's timeout (Envoy answers the call 504 for it).
    Timeout,
    /// The connection failed or was reset before an answer (Envoy answers the call 503).
    Reset { detail: String },
    /// The call ended without any answer at all (no `:status`).
    NoResponse,
    /// Envoy refused the call, e.g. for a cluster it does not know.
    DispatchError { detail: String },
    /// Envoy refused the call itself because the cluster's circuit breaker
    /// (`max_requests`, `max_pending_requests`) is full: the subscriber was not called.
    Overflow { detail: String },
    /// A subscriber's reply was larger than `max_body_bytes`: a failed reply, never a
    /// truncated one.
    TooLarge { size: usize, limit: u64 },
}

impl Failure {
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::Status { .. } => "status",
            Failure::Timeout => "timeout",
            Failure::Reset { .. } => "reset",
            Failure::NoResponse => "no_response",
            Failure::DispatchError { .. } => "dispatch_error",
            Failure::Overflow { .. } => "overflow",
            Failure::TooLarge { .. } => "too_large",
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Status { status, detail } => write!(f, "status {status}: {detail}"),
            Failure::Timeout => write!(f, "timeout"),
            Failure::Reset { detail } => write!(f, "reset: {detail}"),
            Failure::NoResponse => write!(f, "no response"),
            Failure::DispatchError { detail } => write!(f, "dispatch error: {detail}"),
            Failure::Overflow { detail } => write!(f, "overflow: {detail}"),
            Failure::TooLarge { size, limit } => write!(f, "{}", too_large_detail(*size, *limit)),
        }
    }
}

fn too_large_detail(size: usize, limit: u64) -> String {
    format!("the reply of {size} bytes is larger than max_body_bytes ({limit}): not passed on")
}

/// Envoy answers a call itself when the subscriber did not: these are its bodies (the router's
/// local replies), which tell a timeout or a reset from a subscriber's own 503/504.
const ENVOY_TIMEOUT_BODY: &[u8] = b"upstream request timeout";
const ENVOY_RESET_PREFIX: &[u8] = b"upstream connect error or disconnect/reset before headers";
/// How that body ends when the circuit breaker refused the call (Envoy 1.40: a call that had
/// to wait for a connection, refused once it had one).
const ENVOY_OVERFLOW_SUFFIX: &[u8] = b"reset reason: overflow";

/// An overflow, as the report and the dead letter tell it; `how` is what Envoy said.
pub fn overflow(cluster: &str, how: &str) -> Failure {
    Failure::Overflow {
        detail: format!(
            "Envoy's circuit breaker of cluster \"{cluster}\" is full (its max_requests or \
             max_pending_requests): the call was not sent ({how})"
        ),
    }
}

/// Classifies the answer to a call to `cluster`. `status` is `None` when the answer had no
/// `:status`; `body_head` is the start of the answer's body (read only for non-2xx answers).
pub fn classify(cluster: &str, status: Option<u16>, body_head: &[u8]) -> Result<(), Failure> {
    match status {
        None => Err(Failure::NoResponse),
        Some(200..=299) => Ok(()),
        Some(504) if body_head == ENVOY_TIMEOUT_BODY => Err(Failure::Timeout),
        Some(503)
            if body_head.starts_with(ENVOY_RESET_PREFIX)
                && body_head.ends_with(ENVOY_OVERFLOW_SUFFIX) =>
        {
            Err(overflow(cluster, "503, reset reason: overflow"))
        }
        // 503 for a refused or reset connection, 502 for an answer that is not HTTP ("reset
        // reason: protocol error"): either way the subscriber never answered.
        Some(_) if body_head.starts_with(ENVOY_RESET_PREFIX) => Err(Failure::Reset {
            detail: sanitize(body_head, BODY_PEEK_BYTES),
        }),
        Some(status) => Err(Failure::Status {
            status,
            detail: sanitize(body_head, BODY_PEEK_BYTES),
        }),
    }
}

/// Is a status one that counts as delivered?
pub fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// Which call of a subscriber's delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    /// The event, to the subscriber.
    Event,
    /// The subscriber's answer, to its reply target.
    Reply,
    /// The event, to the dead-letter target, after the subscriber failed for good.
    DeadLetter,
}

impl Leg {
    pub fn name(self) -> &'static str {
        match self {
            Leg::Event => "event",
            Leg::Reply => "reply",
            Leg::DeadLetter => "dead_letter",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_table() {
        let reset = b"upstream connect error or disconnect/reset before headers. reset reason: connection termination";
        assert_eq!(classify("c", Some(200), b""), Ok(()));
        assert_eq!(classify("c", Some(204), b""), Ok(()));
        assert_eq!(classify("c", Some(299), b""), Ok(()));
        assert_eq!(classify("c", None, b""), Err(Failure::NoResponse));
        assert_eq!(
            classify("c", Some(504), b"upstream request timeout"),
            Err(Failure::Timeout)
        );
        assert!(matches!(
            classify("c", Some(503), reset),
            Err(Failure::Reset { detail }) if detail.contains("connection termination")
        ));
        let protocol_error = b"upstream connect error or disconnect/reset before headers. reset reason: protocol error";
        assert!(matches!(
            classify("c", Some(502), protocol_error),
            Err(Failure::Reset { detail }) if detail.contains("protocol error")
        ));
        // A subscriber's own 503/504 is its status, not ours.
        assert!(matches!(
            classify("c", Some(504), b"gateway timeout"),
            Err(Failure::Status { status: 504, .. })
        ));
        let overflow =
            b"upstream connect error or disconnect/reset before headers. reset reason: overflow";
        assert!(matches!(
            classify("billing", Some(503), overflow),
            Err(Failure::Overflow { detail }) if detail.contains("circuit breaker of cluster \"billing\"")
        ));
        assert!(matches!(
            classify("c", Some(503), b"busy"),
            Err(Failure::Status { status: 503, .. })
        ));
        assert!(matches!(
            classify("c", Some(300), b""),
            Err(Failure::Status { status: 300, .. })
        ));
        assert!(matches!(
            classify("c", Some(404), b"not here"),
            Err(Failure::Status { status: 404, detail }) if detail == "not here"
        ));
    }
}
