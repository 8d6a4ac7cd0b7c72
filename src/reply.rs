//! Which subscriber answers are reply events, after Knative's data-plane contract
//! (knative/specs `specs/eventing/data-plane.md`, "Derived (Reply) Events") and its dispatcher
//! (knative/eventing `pkg/kncloudevents/event_dispatcher.go`).
//!
//! - Only a subscriber with a reply target is asked for replies (`Prefer: reply`), and only its
//!   answers are looked at.
//! - A `202` is never a reply, whatever its body: the spec says so.
//! - Another 2xx is a reply when it is a valid CloudEvent: in binary mode `ce-specversion`
//!   (1.0 or 0.3) with the other required attributes (`ce-id`, `ce-source`, `ce-type`, not
//!   empty, UTF-8 once percent-decoded), or in structured mode the content type
//!   `application/cloudevents+json`. Anything else with a body or a `ce-*` header (a batch,
//!   `ce-*` headers without `ce-specversion`, a binary event missing an attribute) is
//!   discarded: the delivery is done. Knative's SDK (sdk-go `binding.ToEvent`) takes any
//!   answer with `ce-specversion` and its dispatcher forwards it unchecked; fanout also asks
//!   for the required attributes (docs/delivery.md, "Replies"). A 2xx with
//!   neither a body nor `ce-*` headers is simply done.
//! - A reply goes on with its event headers (`content-type`, `ce-*`) and the pass-through
//!   headers Knative's dispatcher keeps (knative/eventing `pkg/utils/headers.go`):
//!   `x-request-id`, `knative-*` and `x-b3-*`. Not `retry-after`, which Knative's list also
//!   has: on a request to the reply target it would ask nothing of anyone.
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
pub enum Replied {
    /// Neither a body nor a CloudEvent: done, nothing to pass on.
    Nothing,
    /// Not a valid CloudEvent (a body, or `ce-*` headers without a valid event): not a reply,
    /// discarded (and counted).
    NotAnEvent,
    /// A reply event larger than `max_body_bytes`: a failed reply, its body not to be read.
    TooLarge(Failure),
    /// A reply event: these headers (values as they came), and its whole body, go to the
    /// reply target.
    Event(Vec<(String, Vec<u8>)>),
}

/// What an answer with these headers and a body of `body_size` bytes is, when replies may be at
/// most `max_body_bytes`.
pub fn read(headers: Vec<(String, Vec<u8>)>, body_size: usize, max_body_bytes: u64) -> Replied {
    match event_headers(headers) {
        Reading::NoEvent if body_size == 0 => Replied::Nothing,
        Reading::NoEvent | Reading::NotValid => Replied::NotAnEvent,
        Reading::Event(_) if u64::try_from(body_size).unwrap_or(u64::MAX) > max_body_bytes => {
            Replied::TooLarge(Failure::TooLarge {
                size: body_size,
                limit: max_body_bytes,
            })
        }
        Reading::Event(headers) => Replied::Event(headers),
    }
}

/// What an answer's headers tell of it: a reply event (with the headers that travel with it),
/// something that looks like an event but is not a valid one, or nothing of an event.
#[derive(Debug, PartialEq, Eq)]
enum Reading {
    Event(Vec<(String, Vec<u8>)>),
    NotValid,
    NoEvent,
}

/// Whether a header of the answer goes on with the reply: the event's own, and Knative's
/// pass-through headers.
fn travels(name: &str) -> bool {
    name == "content-type"
        || name.starts_with("ce-")
        || name == "x-request-id"
        || name.starts_with("knative-")
        || name.starts_with("x-b3-")
}

/// Reads an answer's headers: a valid CloudEvent in binary or structured mode is an event,
/// with its `travels` headers, byte for byte (a value with CR, LF or NUL, which would split
/// the reply's header block, is dropped). What decides it is read by the HTTP binding's rule:
/// the required attributes must be UTF-8 once percent-decoded; any other value is carried.
fn event_headers(headers: Vec<(String, Vec<u8>)>) -> Reading {
    let mut looks_like_event = false;
    let kept: Vec<(String, Vec<u8>)> = headers
        .into_iter()
        .filter(|(name, _)| travels(name))
        .inspect(|(name, _)| looks_like_event |= name.starts_with("ce-"))
        .filter(|(_, value)| crate::headers::is_valid_value(value))
        .collect();
    let value = |name: &str| {
        kept.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    };
    let media_type = value("content-type").map(crate::cloudevents::media_type);
    if media_type.as_deref() == Some(crate::cloudevents::STRUCTURED_JSON) {
        return Reading::Event(kept);
    }
    let cloudevents_type = media_type
        .as_deref()
        .is_some_and(|m| m.starts_with("application/cloudevents"));
    if value("ce-specversion").is_some() && binary_attributes_valid(&value) {
        return Reading::Event(kept);
    }
    if looks_like_event || cloudevents_type {
        Reading::NotValid
    } else {
        Reading::NoEvent
    }
}

/// Binary mode's required attributes: present, not empty, UTF-8 once decoded, and a
/// `specversion` fanout knows.
fn binary_attributes_valid<'a>(value: &impl Fn(&str) -> Option<&'a [u8]>) -> bool {
    crate::cloudevents::check_binary_required(value).is_ok()
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

    /// A binary event's required headers, with `more` (in their place when they name one).
    fn binary(more: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        let mut all = vec![
            ("ce-specversion", "1.0"),
            ("ce-id", "r-1"),
            ("ce-source", "/billing"),
            ("ce-type", "com.example.reply"),
        ];
        for (name, value) in more {
            match all.iter_mut().find(|(n, _)| n == name) {
                Some(pair) => pair.1 = value,
                None => all.push((name, value)),
            }
        }
        headers(&all)
    }

    fn kept(pairs: &[(&str, &str)]) -> Reading {
        Reading::Event(
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect(),
        )
    }

    #[test]
    fn binary_and_structured_answers_are_replies_with_their_event_and_pass_through_headers() {
        let reply = event_headers(binary(&[
            (":status", "200"),
            ("content-type", "application/json"),
            ("set-cookie", "secret"),
            ("x-request-id", "abc"),
            ("knative-trace", "t1"),
            ("x-b3-traceid", "b3"),
            ("traceparent", "00-1-2-01"),
            ("retry-after", "5"),
        ]));
        assert_eq!(
            reply,
            kept(&[
                ("ce-specversion", "1.0"),
                ("ce-id", "r-1"),
                ("ce-source", "/billing"),
                ("ce-type", "com.example.reply"),
                ("content-type", "application/json"),
                ("x-request-id", "abc"),
                ("knative-trace", "t1"),
                ("x-b3-traceid", "b3"),
            ])
        );
        for content_type in [
            "application/cloudevents+json",
            "Application/CloudEvents+JSON; charset=utf-8",
        ] {
            let reply = event_headers(headers(&[("content-type", content_type)]));
            assert_eq!(
                reply,
                kept(&[("content-type", content_type)]),
                "{content_type}"
            );
        }
        let version_03 = event_headers(headers(&[
            ("ce-specversion", "0.3"),
            ("ce-id", "1"),
            ("ce-source", "%2Fa"),
            ("ce-type", "t"),
        ]));
        assert!(matches!(version_03, Reading::Event(_)));
    }

    #[test]
    fn what_looks_like_an_event_but_is_not_a_valid_one_is_not_a_reply() {
        for (why, answer) in [
            ("a ce-* header alone", headers(&[("ce-abc", "x")])),
            (
                "no ce-specversion",
                headers(&[("ce-id", "1"), ("ce-source", "/s"), ("ce-type", "t")]),
            ),
            (
                "an unknown specversion",
                binary(&[("ce-specversion", "2.0")]),
            ),
            (
                "an empty ce-id",
                headers(&[
                    ("ce-specversion", "1.0"),
                    ("ce-id", ""),
                    ("ce-source", "/s"),
                    ("ce-type", "t"),
                ]),
            ),
            (
                "a ce-type that is not UTF-8 once percent-decoded",
                headers(&[
                    ("ce-specversion", "1.0"),
                    ("ce-id", "1"),
                    ("ce-source", "/s"),
                    ("ce-type", "%FF"),
                ]),
            ),
            (
                "a batch",
                headers(&[("content-type", "application/cloudevents-batch+json")]),
            ),
            // A ce-* header that cannot be passed on does not make an event either.
            (
                "a ce-* value with a newline",
                binary(&[("ce-type", "a\nb")]),
            ),
        ] {
            assert_eq!(
                event_headers(answer.clone()),
                Reading::NotValid,
                "{why}: {answer:?}"
            );
            assert_eq!(
                read(answer, 0, 10),
                Replied::NotAnEvent,
                "{why}: discarded, counted"
            );
        }
    }

    #[test]
    fn an_answer_is_nothing_discarded_too_large_or_a_reply() {
        let event = || binary(&[]);
        let plain = || headers(&[("content-type", "text/plain")]);
        assert_eq!(read(plain(), 0, 10), Replied::Nothing);
        assert_eq!(read(plain(), 1, 10), Replied::NotAnEvent);
        assert_eq!(
            read(plain(), 11, 10),
            Replied::NotAnEvent,
            "discarded, whatever its size"
        );
        let reply = match event_headers(event()) {
            Reading::Event(headers) => Replied::Event(headers),
            other => panic!("{other:?}"),
        };
        assert_eq!(read(event(), 0, 10), reply, "an event without data");
        assert_eq!(read(event(), 10, 10), reply, "at the limit");
        assert_eq!(
            read(event(), 11, 10),
            Replied::TooLarge(Failure::TooLarge {
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
            headers(&[("x-request-id", "abc")]),
        ] {
            assert_eq!(
                event_headers(answer.clone()),
                Reading::NoEvent,
                "{answer:?}"
            );
        }
        let not_utf8 = vec![("ce-type".to_string(), vec![0xff])];
        assert_eq!(event_headers(not_utf8), Reading::NotValid);
    }
}
