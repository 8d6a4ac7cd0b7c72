//! The state of one fan-out: one call per subscriber, each pending until it ends, and the
//! verdict once all have ended.
//!
//! It knows nothing of who performs the calls (the stream's context today; the root context
//! once deliveries outlive a request) nor of proxy-wasm: the glue reports what happened to
//! each call (dispatched with a token, refused at dispatch, answered) and asks for the
//! verdict when [`FanOut::is_done`]. Tokens it does not know, or knows as already ended, are
//! ignored, so a late or duplicate callback cannot change an answer.

use serde::Serialize;

use crate::answer::{sanitize, Answer, FAILED_HEADER};
use crate::config::Channel;

/// How much of a failed subscriber's answer the report quotes.
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
}

impl Failure {
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::Status { .. } => "status",
            Failure::Timeout => "timeout",
            Failure::Reset { .. } => "reset",
            Failure::NoResponse => "no_response",
            Failure::DispatchError { .. } => "dispatch_error",
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
        }
    }
}

/// Envoy answers a call itself when the subscriber did not: these are its bodies (the router's
/// local replies), which tell a timeout or a reset from a subscriber's own 503/504.
const ENVOY_TIMEOUT_BODY: &[u8] = b"upstream request timeout";
const ENVOY_RESET_PREFIX: &[u8] = b"upstream connect error or disconnect/reset before headers";

/// Classifies a call's answer. `status` is `None` when the answer had no `:status`;
/// `body_head` is the start of the answer's body (read only for non-2xx answers).
pub fn classify(status: Option<u16>, body_head: &[u8]) -> Result<(), Failure> {
    match status {
        None => Err(Failure::NoResponse),
        Some(200..=299) => Ok(()),
        Some(504) if body_head == ENVOY_TIMEOUT_BODY => Err(Failure::Timeout),
        Some(503) if body_head.starts_with(ENVOY_RESET_PREFIX) => Err(Failure::Reset {
            detail: sanitize(body_head, DETAIL_BYTES),
        }),
        Some(status) => Err(Failure::Status {
            status,
            detail: sanitize(body_head, DETAIL_BYTES),
        }),
    }
}

/// Is a status one that counts as delivered?
pub fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum CallState {
    /// Not dispatched yet.
    Idle,
    Pending {
        token: u32,
    },
    Delivered,
    Failed {
        failure: Failure,
        elapsed_ms: u64,
    },
}

#[derive(Debug, Clone)]
struct Call {
    state: CallState,
    attempts: u32,
}

/// One request's fan-out.
#[derive(Debug)]
pub struct FanOut {
    channel: usize,
    started_ms: u64,
    calls: Vec<Call>,
    /// Calls not yet ended (idle or pending).
    open: usize,
}

impl FanOut {
    /// A fan-out of `subscribers` calls for the channel at index `channel`, started at
    /// `now_ms` (any clock; only differences are reported).
    pub fn new(channel: usize, subscribers: usize, now_ms: u64) -> FanOut {
        FanOut {
            channel,
            started_ms: now_ms,
            calls: vec![
                Call {
                    state: CallState::Idle,
                    attempts: 0,
                };
                subscribers
            ],
            open: subscribers,
        }
    }

    pub fn channel(&self) -> usize {
        self.channel
    }

    /// The call to subscriber `index` is under way with `token`.
    pub fn dispatched(&mut self, index: usize, token: u32) {
        if let Some(call) = self.calls.get_mut(index) {
            if call.state == CallState::Idle {
                call.state = CallState::Pending { token };
                call.attempts += 1;
            }
        }
    }

    /// Envoy refused the call to subscriber `index`: no callback will come for it.
    pub fn dispatch_failed(&mut self, index: usize, detail: String, now_ms: u64) {
        if let Some(call) = self.calls.get_mut(index) {
            if call.state == CallState::Idle {
                call.attempts += 1;
                self.end(index, Err(Failure::DispatchError { detail }), now_ms);
            }
        }
    }

    /// The call with `token` ended with `result`. Returns the subscriber's index, or `None`
    /// (and changes nothing) for a token this fan-out is not waiting for.
    pub fn completed(
        &mut self,
        token: u32,
        result: Result<(), Failure>,
        now_ms: u64,
    ) -> Option<usize> {
        let index = self
            .calls
            .iter()
            .position(|call| call.state == CallState::Pending { token })?;
        self.end(index, result, now_ms);
        Some(index)
    }

    fn end(&mut self, index: usize, result: Result<(), Failure>, now_ms: u64) {
        if let Some(call) = self.calls.get_mut(index) {
            call.state = match result {
                Ok(()) => CallState::Delivered,
                Err(failure) => CallState::Failed {
                    failure,
                    elapsed_ms: now_ms.saturating_sub(self.started_ms),
                },
            };
            self.open -= 1;
        }
    }

    /// Every call has ended.
    pub fn is_done(&self) -> bool {
        self.open == 0
    }

    /// Number of calls still pending.
    pub fn open(&self) -> usize {
        self.open
    }

    /// The failed calls, by subscriber index.
    pub fn failures(&self) -> impl Iterator<Item = (usize, &Failure)> {
        self.calls
            .iter()
            .enumerate()
            .filter_map(|(i, call)| match &call.state {
                CallState::Failed { failure, .. } => Some((i, failure)),
                _ => None,
            })
    }

    /// The answer for the sender: 202 when every subscriber took the event, else the 500
    /// report. Meaningful once [`FanOut::is_done`].
    pub fn verdict(&self, channel: &Channel) -> Answer {
        let failed: Vec<FailedSubscriber<'_>> = self
            .calls
            .iter()
            .zip(&channel.subscribers)
            .filter_map(|(call, sub)| match &call.state {
                CallState::Failed {
                    failure,
                    elapsed_ms,
                } => Some(FailedSubscriber::new(
                    sub,
                    failure,
                    call.attempts,
                    *elapsed_ms,
                )),
                _ => None,
            })
            .collect();
        if failed.is_empty() {
            return Answer::accepted();
        }
        let delivered = self
            .calls
            .iter()
            .filter(|call| call.state == CallState::Delivered)
            .count();
        let count = failed.len();
        let report = Report {
            channel: &channel.name,
            subscribers: self.calls.len(),
            delivered,
            failed,
        };
        Answer::json(500, &report).with_header(FAILED_HEADER, count.to_string())
    }
}

/// The body of a 500: which subscribers did not take the event, and why.
#[derive(Serialize)]
struct Report<'a> {
    channel: &'a str,
    subscribers: usize,
    delivered: usize,
    failed: Vec<FailedSubscriber<'a>>,
}

#[derive(Serialize)]
struct FailedSubscriber<'a> {
    cluster: &'a str,
    authority: &'a str,
    path: &'a str,
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    detail: String,
    attempts: u32,
    elapsed_ms: u64,
}

impl<'a> FailedSubscriber<'a> {
    fn new(
        sub: &'a crate::config::Subscriber,
        failure: &Failure,
        attempts: u32,
        elapsed_ms: u64,
    ) -> Self {
        let (status, detail) = match failure {
            Failure::Status { status, detail } => (Some(*status), detail.clone()),
            Failure::Timeout => (
                None,
                format!(
                    "no answer within the timeout of {} ms",
                    sub.timeout.as_millis()
                ),
            ),
            Failure::Reset { detail } => (None, detail.clone()),
            Failure::NoResponse => (None, "the call ended without an answer".to_string()),
            Failure::DispatchError { detail } => (None, detail.clone()),
        };
        FailedSubscriber {
            cluster: &sub.cluster,
            authority: &sub.authority,
            path: &sub.path,
            outcome: failure.kind(),
            status,
            detail,
            attempts,
            elapsed_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn channel(n: usize) -> Channel {
        let subs: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"cluster": "c{i}", "path": "/p{i}", "timeout_ms": 250}}"#))
            .collect();
        let json = format!(r#"{{"subscribers": [{}]}}"#, subs.join(","));
        let mut config = Config::from_json(json.as_bytes()).unwrap();
        config.channels.remove(0)
    }

    fn report(answer: &Answer) -> serde_json::Value {
        serde_json::from_slice(&answer.body).unwrap()
    }

    #[test]
    fn classification_table() {
        let reset = b"upstream connect error or disconnect/reset before headers. reset reason: connection termination";
        assert_eq!(classify(Some(200), b""), Ok(()));
        assert_eq!(classify(Some(204), b""), Ok(()));
        assert_eq!(classify(Some(299), b""), Ok(()));
        assert_eq!(classify(None, b""), Err(Failure::NoResponse));
        assert_eq!(
            classify(Some(504), b"upstream request timeout"),
            Err(Failure::Timeout)
        );
        assert!(matches!(
            classify(Some(503), reset),
            Err(Failure::Reset { detail }) if detail.contains("connection termination")
        ));
        // A subscriber's own 503/504 is its status, not ours.
        assert!(matches!(
            classify(Some(504), b"gateway timeout"),
            Err(Failure::Status { status: 504, .. })
        ));
        assert!(matches!(
            classify(Some(503), b"busy"),
            Err(Failure::Status { status: 503, .. })
        ));
        assert!(matches!(
            classify(Some(300), b""),
            Err(Failure::Status { status: 300, .. })
        ));
        assert!(matches!(
            classify(Some(404), b"not here"),
            Err(Failure::Status { status: 404, detail }) if detail == "not here"
        ));
    }

    #[test]
    fn all_delivered_is_202() {
        let ch = channel(3);
        let mut f = FanOut::new(0, 3, 1000);
        for i in 0..3 {
            f.dispatched(i, 10 + i as u32);
        }
        assert!(!f.is_done());
        assert!(f.completed(11, Ok(()), 1001).is_some());
        assert!(f.completed(10, Ok(()), 1002).is_some());
        assert_eq!(f.open(), 1);
        assert!(f.completed(12, Ok(()), 1003).is_some());
        assert!(f.is_done());
        assert_eq!(f.verdict(&ch), Answer::accepted());
    }

    #[test]
    fn no_subscribers_is_done_at_once_and_202() {
        let f = FanOut::new(0, 0, 0);
        assert!(f.is_done());
        assert_eq!(f.verdict(&channel(0)).status, 202);
    }

    #[test]
    fn one_failure_makes_a_500_report_naming_it() {
        let ch = channel(3);
        let mut f = FanOut::new(0, 3, 1000);
        f.dispatched(0, 1);
        f.dispatched(1, 2);
        f.dispatch_failed(2, "unknown cluster".into(), 1000);
        f.completed(1, Ok(()), 1005);
        f.completed(
            2,
            Err(Failure::Status {
                status: 500,
                detail: "boom".into(),
            }),
            1042,
        );
        assert!(f.is_done());
        let answer = f.verdict(&ch);
        assert_eq!(answer.status, 500);
        assert!(answer.headers.contains(&(FAILED_HEADER, "2".to_string())));
        assert!(answer
            .headers
            .contains(&("content-type", "application/json".to_string())));
        let doc = report(&answer);
        assert_eq!(doc["channel"], "default");
        assert_eq!(doc["subscribers"], 3);
        assert_eq!(doc["delivered"], 1);
        let failed = doc["failed"].as_array().unwrap();
        assert_eq!(failed.len(), 2);
        assert_eq!(failed[0]["cluster"], "c1");
        assert_eq!(failed[0]["path"], "/p1");
        assert_eq!(failed[0]["outcome"], "status");
        assert_eq!(failed[0]["status"], 500);
        assert_eq!(failed[0]["detail"], "boom");
        assert_eq!(failed[0]["attempts"], 1);
        assert_eq!(failed[0]["elapsed_ms"], 42);
        assert_eq!(failed[1]["cluster"], "c2");
        assert_eq!(failed[1]["outcome"], "dispatch_error");
        assert_eq!(failed[1]["detail"], "unknown cluster");
        assert!(failed[1].get("status").is_none());
    }

    #[test]
    fn timeout_report_says_the_timeout() {
        let ch = channel(1);
        let mut f = FanOut::new(0, 1, 0);
        f.dispatched(0, 7);
        f.completed(7, Err(Failure::Timeout), 251);
        let doc = report(&f.verdict(&ch));
        assert_eq!(doc["failed"][0]["outcome"], "timeout");
        assert_eq!(
            doc["failed"][0]["detail"],
            "no answer within the timeout of 250 ms"
        );
    }

    #[test]
    fn every_call_refused_at_dispatch_is_done_at_once() {
        let mut f = FanOut::new(0, 2, 0);
        f.dispatch_failed(0, "x".into(), 0);
        assert!(!f.is_done());
        f.dispatch_failed(1, "y".into(), 0);
        assert!(f.is_done());
        assert_eq!(f.verdict(&channel(2)).status, 500);
    }

    #[test]
    fn late_unknown_and_duplicate_tokens_are_ignored() {
        let ch = channel(2);
        let mut f = FanOut::new(0, 2, 0);
        f.dispatched(0, 1);
        f.dispatched(1, 2);
        assert!(f.completed(99, Ok(()), 0).is_none(), "unknown token");
        assert!(f.completed(1, Err(Failure::NoResponse), 0).is_some());
        assert!(f.completed(1, Ok(()), 0).is_none(), "duplicate token");
        assert_eq!(f.open(), 1);
        assert!(f.completed(2, Ok(()), 0).is_some());
        assert!(
            f.completed(2, Err(Failure::NoResponse), 0).is_none(),
            "late token"
        );
        assert_eq!(f.failures().count(), 1);
        assert_eq!(f.verdict(&ch).status, 500);
    }

    #[test]
    fn a_call_is_dispatched_or_refused_once() {
        let mut f = FanOut::new(0, 1, 0);
        f.dispatched(0, 1);
        f.dispatch_failed(0, "late".into(), 0);
        f.dispatched(0, 2);
        assert!(f.completed(2, Ok(()), 0).is_none());
        assert!(f.completed(1, Ok(()), 0).is_some());
        assert!(f.is_done());
        // out-of-range indexes change nothing
        f.dispatched(5, 3);
        f.dispatch_failed(5, "x".into(), 0);
        assert!(f.is_done());
    }
}
