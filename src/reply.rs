//! Which subscriber answers are reply events, after Knative's data-plane contract
//! (knative/specs `specs/eventing/data-plane.md`, "Derived (Reply) Events") and its dispatcher
//! (knative/eventing `pkg/kncloudevents/event_dispatcher.go`).
//!
//! - Only a subscriber with a reply target is asked for replies (`Prefer: reply`), and only its
//!   answers are looked at.
//! - A `202` is never a reply, whatever its body: the spec says so.
//! - Another 2xx is a reply when it is a CloudEvent: in binary mode (some `ce-*` header), or in
//!   structured or batched mode (a `content-type` of `application/cloudevents...`). Anything
//!   else is discarded, as Knative's dispatcher discards what does not decode as an event: the
//!   delivery is done. A 2xx with neither a body nor `ce-*` headers is simply done.
//! - A reply larger than `max_body_bytes` is not passed on cut short: it is a failed reply
//!   ([`crate::call::Failure::TooLarge`]).
//!
//! It knows nothing of proxy-wasm; `deliveries` reads an answer's headers and body only when
//! these functions say it must.

use crate::call::{is_success, Failure};

/// The `prefer` header of a call to a subscriber with a reply target.
pub const PREFER_REPLY: (&str, &str) = ("prefer", "reply");

/// Whether a subscriber's answer with `status` may be a reply event, so that its headers are
/// worth reading.
pub fn may_be_reply(status: u16) -> bool {
    is_success(status) && status != 202
}

/// What a subscriber's 2xx answer (other than 202) is to its reply target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered {
    /// Neither a body nor a CloudEvent: done, nothing to pass on.
    Nothing,
    /// A body that is not a CloudEvent: not a reply, discarded (and counted).
    NotAnEvent,
    /// A reply event larger than `max_body_bytes`: a failed reply, its body not to be read.
    TooLarge(Failure),
    /// A reply event: these headers, and its whole body, go to the reply target.
    Event(Vec<(String, String)>),
}

/// What an answer with these headers and a body of `body_size` bytes is, when replies may be at
/// most `max_body_bytes`.
pub fn read(headers: Vec<(String, Vec<u8>)>, body_size: usize, max_body_bytes: u64) -> Answered {
    match event_headers(headers) {
        None if body_size == 0 => Answered::Nothing,
        None => Answered::NotAnEvent,
        Some(_) if u64::try_from(body_size).unwrap_or(u64::MAX) > max_body_bytes => {
            Answered::TooLarge(Failure::TooLarge {
                size: body_size,
                limit: max_body_bytes,
            })
        }
        Some(headers) => Answered::Event(headers),
    }
}

/// The answer's headers that travel with it as a reply event (`content-type` and `ce-*`, as
/// valid header values), if the answer is a CloudEvent; `None` if it is not one.
fn event_headers(headers: Vec<(String, Vec<u8>)>) -> Option<Vec<(String, String)>> {
    let mut cloudevent = false;
    let kept: Vec<(String, String)> = headers
        .into_iter()
        .filter(|(name, _)| name == "content-type" || name.starts_with("ce-"))
        .filter_map(|(name, value)| String::from_utf8(value).ok().map(|v| (name, v)))
        .filter(|(_, value)| crate::headers::is_valid_value(value))
        .inspect(|(name, value)| {
            cloudevent |= name.starts_with("ce-")
                || crate::cloudevents::media_type(value.as_bytes())
                    .starts_with("application/cloudevents");
        })
        .collect();
    cloudevent.then_some(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn a_202_or_a_failure_is_never_a_reply() {
        for status in [200, 201, 203, 204, 206, 299] {
            assert!(may_be_reply(status), "{status}");
        }
        for status in [202, 100, 199, 300, 404, 500] {
            assert!(!may_be_reply(status), "{status}");
        }
    }

    #[test]
    fn binary_structured_and_batched_answers_are_replies_with_their_event_headers() {
        let binary = event_headers(headers(&[
            (":status", "200"),
            ("content-type", "application/json"),
            ("ce-type", "com.example.reply"),
            ("set-cookie", "secret"),
        ]));
        assert_eq!(
            binary,
            Some(vec![
                ("content-type".to_string(), "application/json".to_string()),
                ("ce-type".to_string(), "com.example.reply".to_string()),
            ])
        );
        for content_type in [
            "application/cloudevents+json",
            "Application/CloudEvents+JSON; charset=utf-8",
            "application/cloudevents-batch+json",
        ] {
            let reply = event_headers(headers(&[("content-type", content_type)]));
            assert_eq!(
                reply,
                Some(vec![("content-type".to_string(), content_type.to_string())]),
                "{content_type}"
            );
        }
    }

    #[test]
    fn an_answer_is_nothing_discarded_too_large_or_a_reply() {
        let event = || headers(&[("ce-type", "t")]);
        let plain = || headers(&[("content-type", "text/plain")]);
        assert_eq!(read(plain(), 0, 10), Answered::Nothing);
        assert_eq!(read(plain(), 1, 10), Answered::NotAnEvent);
        assert_eq!(
            read(plain(), 11, 10),
            Answered::NotAnEvent,
            "discarded, whatever its size"
        );
        let reply = Answered::Event(vec![("ce-type".to_string(), "t".to_string())]);
        assert_eq!(read(event(), 0, 10), reply, "an event without data");
        assert_eq!(read(event(), 10, 10), reply, "at the limit");
        assert_eq!(
            read(event(), 11, 10),
            Answered::TooLarge(Failure::TooLarge {
                size: 11,
                limit: 10
            })
        );
    }

    #[test]
    fn anything_else_is_not_a_reply() {
        for answer in [
            headers(&[]),
            headers(&[("content-type", "application/json")]),
            headers(&[("content-type", "text/plain"), ("x-ce-type", "no")]),
            // A ce-* header that cannot be passed on does not make an event.
            headers(&[("content-type", "text/plain"), ("ce-type", "a\nb")]),
        ] {
            assert_eq!(event_headers(answer.clone()), None, "{answer:?}");
        }
        let not_utf8 = vec![("ce-type".to_string(), vec![0xff])];
        assert_eq!(event_headers(not_utf8), None);
    }
}
