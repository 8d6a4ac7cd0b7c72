//! Reading a call's end: from the host's answer to a call (its status, and only what that
//! status requires of its headers and body) to a value, [`AnsweredCall`], that the fan-out records.
//!
//! The reads are host calls, so each is made only when needed: a plain success reads its
//! `:status` and nothing else; a success is read further only when it may be a reply event to
//! pass on; a failure reads a peek of its body (for the report) and, when it may be retried,
//! its `retry-after`. Nothing here changes any state.

use crate::call::{classify, is_success, Failure, Leg, BODY_PEEK_BYTES};
use crate::config::Subscriber;
use crate::fan_out_state::{CallEnd, ReplyEvent};
use crate::host::Host;
use crate::reply::{self, Replied};
use crate::retry::{honours_retry_after, parse_retry_after};

/// What is known of a call before its answer is read.
pub struct Expected<'a> {
    pub sub: &'a Subscriber,
    pub leg: Leg,
    /// The cluster the call went to.
    pub cluster: &'a str,
    /// The size of the answer as Envoy announced it.
    pub num_headers: usize,
    pub body_size: usize,
    /// `max_body_bytes`: a reply event larger than this cannot be sent on.
    pub max_body_bytes: u64,
}

/// A call's end, read.
#[derive(Debug)]
pub struct AnsweredCall {
    /// The answer's status; `None` when Envoy answered without headers (reset, timeout).
    pub status: Option<u16>,
    pub end: CallEnd,
    /// A 2xx with a body that is not a CloudEvent, from a subscriber with a reply target:
    /// no reply, and dropped.
    pub discarded: bool,
}

impl AnsweredCall {
    /// The reply event refused before it was sent (too large), if any.
    pub fn reply_refused(&self) -> Option<&Failure> {
        match &self.end.reply {
            Some(Err(failure)) => Some(failure),
            _ => None,
        }
    }
}

/// Reads the end of the call `expected` describes from `host`, whose current call answer it
/// is. `now_ms` is asked only for a `retry-after` date.
pub fn read<H: Host>(
    host: &H,
    expected: &Expected<'_>,
    now_ms: impl FnOnce() -> u64,
) -> AnsweredCall {
    let status = if expected.num_headers == 0 {
        None
    } else {
        host.call_status()
    };
    let mut discarded = false;
    let end = match status {
        Some(status) if is_success(status) => {
            let reply = if expected.leg == Leg::Event
                && expected.sub.reply.is_some()
                && reply::may_be_reply(status)
            {
                read_reply(host, expected, &mut discarded)
            } else {
                None
            };
            CallEnd {
                reply,
                ..CallEnd::ok()
            }
        }
        _ => {
            let body = if expected.body_size > 0 {
                host.call_body(expected.body_size.min(BODY_PEEK_BYTES))
            } else {
                Vec::new()
            };
            let retry_after_ms =
                if expected.sub.retry.retry > 0 && status.is_some_and(honours_retry_after) {
                    host.call_header("retry-after")
                        .and_then(|v| parse_retry_after(&v, now_ms()))
                } else {
                    None
                };
            CallEnd {
                result: classify(expected.cluster, status, &body),
                retry_after_ms,
                body,
                reply: None,
            }
        }
    };
    AnsweredCall {
        status,
        end,
        discarded,
    }
}

/// A success's headers and body, read only to pass a reply event on.
fn read_reply<H: Host>(
    host: &H,
    expected: &Expected<'_>,
    discarded: &mut bool,
) -> Option<Result<ReplyEvent, Failure>> {
    match reply::read(
        host.call_headers(),
        expected.body_size,
        expected.max_body_bytes,
    ) {
        Replied::Nothing => None,
        Replied::NotAnEvent => {
            *discarded = true;
            None
        }
        Replied::TooLarge(failure) => Some(Err(failure)),
        Replied::Event(headers) => Some(Ok(ReplyEvent {
            headers: headers.into_iter().collect(),
            body: if expected.body_size > 0 {
                host.call_body(expected.body_size)
            } else {
                Vec::new()
            },
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    use crate::config::{Channel, Config};
    use crate::testing::FakeHost;

    /// The channel of `json`, whose first subscriber is the one called.
    fn channel(json: &str) -> Rc<Channel> {
        Config::from_json(json.as_bytes()).unwrap().channels[0].clone()
    }

    fn answering(status: Option<u16>, headers: &[(&str, &str)], body: &[u8]) -> FakeHost {
        let host = FakeHost::default();
        {
            let mut state = host.0.borrow_mut();
            state.call_response = (status, body.to_vec());
            state.call_response_headers = headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect();
        }
        host
    }

    fn expected(sub: &Subscriber, leg: Leg, body_size: usize) -> Expected<'_> {
        Expected {
            sub,
            leg,
            cluster: &sub.cluster,
            num_headers: 3,
            body_size,
            max_body_bytes: 1024,
        }
    }

    fn host_calls(host: &FakeHost) -> u64 {
        host.0.borrow().calls.values().sum()
    }

    #[test]
    fn a_plain_success_reads_its_status_only() {
        let channel = channel(r#"{"subscribers": [{"cluster": "billing"}]}"#);
        let sub = &channel.subscribers[0];
        let host = answering(Some(200), &[], b"ignored");
        let ended = read(&host, &expected(sub, Leg::Event, 7), || panic!("no clock"));
        assert_eq!(ended.status, Some(200));
        assert!(ended.end.result.is_ok());
        assert!(ended.end.reply.is_none() && !ended.discarded);
        assert_eq!(host_calls(&host), 1, "{:?}", host.0.borrow().calls);
    }

    #[test]
    fn no_headers_is_an_answer_without_status_and_reads_nothing() {
        let channel = channel(r#"{"subscribers": [{"cluster": "billing"}]}"#);
        let sub = &channel.subscribers[0];
        let host = answering(Some(200), &[], b"");
        let mut expect = expected(sub, Leg::Event, 0);
        expect.num_headers = 0;
        let ended = read(&host, &expect, || 0);
        assert_eq!(ended.status, None);
        assert!(ended.end.result.is_err());
        assert_eq!(host_calls(&host), 0);
    }

    #[test]
    fn a_failure_reads_a_peek_of_its_body_and_no_retry_after_without_retries() {
        let channel = channel(r#"{"subscribers": [{"cluster": "billing"}]}"#);
        let sub = &channel.subscribers[0];
        let body = vec![b'x'; BODY_PEEK_BYTES + 100];
        let host = answering(Some(500), &[("retry-after", "5")], &body);
        let ended = read(&host, &expected(sub, Leg::Event, body.len()), || 0);
        assert_eq!(ended.status, Some(500));
        assert_eq!(ended.end.body.len(), BODY_PEEK_BYTES);
        assert!(matches!(
            ended.end.result,
            Err(Failure::Status { status: 500, .. })
        ));
        assert_eq!(ended.end.retry_after_ms, None);
    }

    #[test]
    fn a_retried_503_reads_its_retry_after() {
        let channel =
            channel(r#"{"subscribers": [{"cluster": "billing", "delivery": {"retry": 2}}]}"#);
        let sub = &channel.subscribers[0];
        let host = answering(Some(503), &[("retry-after", "5")], b"");
        let ended = read(&host, &expected(sub, Leg::Event, 0), || 0);
        assert_eq!(ended.end.retry_after_ms, Some(5000));
    }

    #[test]
    fn a_reply_event_is_read_whole_and_anything_else_is_discarded() {
        let channel = channel(
            r#"{"subscribers": [{"cluster": "billing", "reply": {"cluster": "replies"}}]}"#,
        );
        let sub = &channel.subscribers[0];
        let event = answering(
            Some(200),
            &[
                ("ce-type", "t"),
                ("ce-id", "1"),
                ("ce-source", "/s"),
                ("ce-specversion", "1.0"),
            ],
            b"{}",
        );
        let ended = read(&event, &expected(sub, Leg::Event, 2), || 0);
        let Some(Ok(reply)) = &ended.end.reply else {
            panic!("no reply: {ended:?}");
        };
        assert_eq!(reply.body, b"{}");
        let plain = answering(Some(200), &[("content-type", "text/plain")], b"ok");
        let ended = read(&plain, &expected(sub, Leg::Event, 2), || 0);
        assert!(ended.discarded && ended.end.reply.is_none());
        // A reply leg's own answer is never a reply.
        let ended = read(&event, &expected(sub, Leg::Reply, 2), || 0);
        assert!(ended.end.reply.is_none() && !ended.discarded);
    }

    #[test]
    fn a_reply_larger_than_max_body_bytes_is_refused() {
        let channel = channel(
            r#"{"subscribers": [{"cluster": "billing", "reply": {"cluster": "replies"}}]}"#,
        );
        let sub = &channel.subscribers[0];
        let event = [
            ("ce-type", "t"),
            ("ce-id", "1"),
            ("ce-source", "/s"),
            ("ce-specversion", "1.0"),
        ];
        let host = answering(Some(200), &event, b"");
        let ended = read(&host, &expected(sub, Leg::Event, 4096), || 0);
        assert!(ended.reply_refused().is_some(), "{ended:?}");
    }
}
