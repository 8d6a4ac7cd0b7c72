//! What a dead letter carries: the original event (its forwarded headers and its body), and
//! why its delivery failed for good, in two vocabularies.
//!
//! - fanout's own headers, `x-fanout-failed-*`: the subscriber's cluster, the leg that failed
//!   (`event`, or `reply` when the subscriber took the event and its reply could not be passed
//!   on), the outcome, the status, the start of the answer and the attempts.
//! - Knative's error extension attributes (knative/eventing,
//!   `pkg/kncloudevents/attributes/knative_error.go`), which dead-letter consumers written for
//!   Knative read with a CloudEvents SDK: `knativeerrordest`, the URL of the destination that
//!   failed (`http://<authority><path>`); `knativeerrorcode`, its status; `knativeerrordata`,
//!   its answer's body in base64, at most [`ERROR_DATA_BYTES`] of it. A failure without a
//!   status of the destination's own gets the code Knative's dispatcher gives a call without
//!   an answer, 500 (413 for a reply too large to pass on), and fanout's description of the
//!   failure as data.
//!
//! Where the attributes go follows the event's content mode (CloudEvents HTTP binding): in
//! structured mode (`application/cloudevents+json`) they become members of the event's JSON
//! object, added at its end so the rest of the body stays byte for byte; otherwise (binary
//! mode, or a request that is not a CloudEvent) they are `ce-*` headers, percent-encoded as
//! the binding says, replacing any the request had. A structured body that is not one JSON
//! object, or a structured format other than JSON, is passed on as it came, with only the
//! `x-fanout-failed-*` headers: there is no event object to put the attributes in.

use base64::Engine;

use crate::answer::sanitize;
use crate::call::{Failure, Leg, BODY_PEEK_BYTES};
use crate::cloudevents::{encode_attribute, media_type, STRUCTURED_JSON};
use crate::headers::Forwarded;
use crate::json::members as members_of;

/// Headers on a dead letter: which subscriber failed, how, and the start of its answer.
pub const DEAD_LETTER_CLUSTER: &str = "x-fanout-failed-cluster";
pub const DEAD_LETTER_LEG: &str = "x-fanout-failed-leg";
pub const DEAD_LETTER_OUTCOME: &str = "x-fanout-failed-outcome";
pub const DEAD_LETTER_STATUS: &str = "x-fanout-failed-status";
pub const DEAD_LETTER_BODY: &str = "x-fanout-failed-body";
pub const DEAD_LETTER_ATTEMPTS: &str = "x-fanout-failed-attempts";

/// Knative's error extension attributes.
pub const ERROR_DEST: &str = "knativeerrordest";
pub const ERROR_CODE: &str = "knativeerrorcode";
pub const ERROR_DATA: &str = "knativeerrordata";
/// The most of the failed answer's body `knativeerrordata` carries, before base64.
pub const ERROR_DATA_BYTES: usize = 1024;

/// The binary-mode headers of the attributes; a dead letter's own replace the request's.
const ERROR_HEADERS: [&str; 3] = [
    "ce-knativeerrordest",
    "ce-knativeerrorcode",
    "ce-knativeerrordata",
];

/// The failure that sent an event to its dead-letter target.
#[derive(Debug)]
pub struct Cause<'a> {
    /// The subscriber whose delivery failed.
    pub cluster: &'a str,
    /// Which of its calls failed for good: [`Leg::Event`] or [`Leg::Reply`].
    pub leg: Leg,
    pub failure: &'a Failure,
    /// The start of the failed answer's body.
    pub answer: &'a [u8],
    /// How the report describes the failure.
    pub detail: &'a str,
    /// The destination that failed: the subscriber, or its reply target.
    pub authority: &'a str,
    pub path: &'a str,
    /// Attempts of the event itself.
    pub attempts: u32,
}

/// A dead letter's own part: headers to add, and the body when it is not the event's as it
/// came (structured mode).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetter {
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
}

#[cfg(test)]
impl DeadLetter {
    /// The value of one of its headers.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Whether a forwarded header gives way to the dead letter's own of the same name.
pub fn replaces(name: &str) -> bool {
    ERROR_HEADERS.contains(&name)
}

/// The dead letter for `cause`, of the event with `forwarded` headers and body `event`.
pub fn dead_letter(cause: &Cause<'_>, forwarded: &Forwarded, event: &[u8]) -> DeadLetter {
    let mut headers = fanout_headers(cause);
    let dest = format!("http://{}{}", cause.authority, cause.path);
    let code = error_code(cause.failure);
    let data = base64::engine::general_purpose::STANDARD.encode(error_data(cause));
    let structured = forwarded
        .get("content-type")
        .is_some_and(|value| media_type(value) == STRUCTURED_JSON);
    let body = if structured {
        // serde_json escapes the strings (a string cannot fail to serialize: the fallback is
        // never taken); the code is a JSON number, as an Integer attribute is in the JSON
        // event format.
        let dest = serde_json::to_string(&dest).unwrap_or_else(|_| "\"\"".to_string());
        let members =
            format!("\"{ERROR_DEST}\":{dest},\"{ERROR_CODE}\":{code},\"{ERROR_DATA}\":\"{data}\"");
        with_members(event, &members)
    } else {
        let dest = encode_attribute(&dest);
        headers.extend(
            ERROR_HEADERS
                .iter()
                .zip([dest, code.to_string(), data])
                .map(|(name, value)| (name.to_string(), value)),
        );
        None
    };
    DeadLetter { headers, body }
}

fn fanout_headers(cause: &Cause<'_>) -> Vec<(String, String)> {
    let mut headers = vec![
        (
            DEAD_LETTER_CLUSTER.to_string(),
            sanitize(cause.cluster.as_bytes(), 256),
        ),
        (DEAD_LETTER_LEG.to_string(), cause.leg.name().to_string()),
        (
            DEAD_LETTER_OUTCOME.to_string(),
            cause.failure.kind().to_string(),
        ),
    ];
    let detail = match cause.failure {
        Failure::Status { status, detail } => {
            headers.push((DEAD_LETTER_STATUS.to_string(), status.to_string()));
            detail.as_str()
        }
        Failure::Reset { detail }
        | Failure::DispatchError { detail }
        | Failure::Overflow { detail } => detail.as_str(),
        Failure::TooLarge { .. } => cause.detail,
        Failure::Timeout | Failure::NoResponse => "",
    };
    headers.push((
        DEAD_LETTER_BODY.to_string(),
        sanitize(detail.as_bytes(), BODY_PEEK_BYTES),
    ));
    headers.push((DEAD_LETTER_ATTEMPTS.to_string(), cause.attempts.to_string()));
    headers
}

/// `knativeerrorcode`: the destination's status; without one, what Knative's dispatcher
/// reports for a call that got no answer (500), or 413 for a reply too large to pass on (what
/// fanout answers a request over `max_body_bytes`).
fn error_code(failure: &Failure) -> u16 {
    match failure {
        Failure::Status { status, .. } => *status,
        Failure::TooLarge { .. } => 413,
        Failure::Timeout
        | Failure::Reset { .. }
        | Failure::NoResponse
        | Failure::DispatchError { .. }
        | Failure::Overflow { .. } => 500,
    }
}

/// `knativeerrordata` before base64: the start of the destination's answer, or for a failure
/// without an answer of the destination's own, the report's detail.
fn error_data<'a>(cause: &Cause<'a>) -> &'a [u8] {
    let data = match cause.failure {
        Failure::Status { .. } => cause.answer,
        _ => cause.detail.as_bytes(),
    };
    data.get(..ERROR_DATA_BYTES).unwrap_or(data)
}

/// `event` with `members` (`"name":value` pairs, comma-separated) added at the end of its
/// top-level JSON object, every other byte as it was; `None` if it is not one JSON object.
/// A member of the same name already in the event stays where it is: JSON parsers keep the
/// last of duplicate names (the CloudEvents SDKs do), so the added one is what they read.
fn with_members(event: &[u8], members: &str) -> Option<Vec<u8>> {
    // The same scan `delivery.format` reads a structured body with: one JSON reader.
    let had_members = !members_of(event).ok()?.is_empty();
    // Valid JSON: after the object's closing brace comes only whitespace.
    let close = event.iter().rposition(|&b| b == b'}')?;
    let (before, after) = event.split_at_checked(close)?;
    let mut body = Vec::with_capacity(event.len() + members.len() + 1);
    body.extend_from_slice(before);
    if had_members {
        body.push(b',');
    }
    body.extend_from_slice(members.as_bytes());
    body.extend_from_slice(after);
    Some(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cause<'a>(failure: &'a Failure, answer: &'a [u8], detail: &'a str) -> Cause<'a> {
        Cause {
            cluster: "billing",
            leg: Leg::Event,
            failure,
            answer,
            detail,
            authority: "billing.default.svc",
            path: "/events",
            attempts: 3,
        }
    }

    fn decode(data: &str) -> Vec<u8> {
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap()
    }

    fn binary() -> Forwarded {
        [("ce-id", "1"), ("content-type", "application/json")]
            .into_iter()
            .collect()
    }

    fn structured() -> Forwarded {
        [(
            "content-type",
            "application/cloudevents+json; charset=utf-8",
        )]
        .into_iter()
        .collect()
    }

    fn status(status: u16, detail: &str) -> Failure {
        Failure::Status {
            status,
            detail: detail.into(),
        }
    }

    #[test]
    fn binary_mode_carries_the_attributes_as_ce_headers_and_keeps_the_body() {
        let failure = status(503, "busy\nnow");
        let letter = dead_letter(&cause(&failure, b"busy\nnow", "busy now"), &binary(), b"{}");
        assert_eq!(letter.body, None, "the body is the event's as it came");
        assert_eq!(
            letter.header("ce-knativeerrordest"),
            Some("http://billing.default.svc/events")
        );
        assert_eq!(letter.header("ce-knativeerrorcode"), Some("503"));
        let data = letter.header("ce-knativeerrordata").unwrap();
        assert_eq!(
            decode(data),
            b"busy\nnow",
            "the raw answer, not the sanitized one"
        );
        // fanout's own headers are kept.
        assert_eq!(letter.header(DEAD_LETTER_CLUSTER), Some("billing"));
        assert_eq!(letter.header(DEAD_LETTER_LEG), Some("event"));
        assert_eq!(letter.header(DEAD_LETTER_OUTCOME), Some("status"));
        assert_eq!(letter.header(DEAD_LETTER_STATUS), Some("503"));
        assert_eq!(letter.header(DEAD_LETTER_BODY), Some("busy now"));
        assert_eq!(letter.header(DEAD_LETTER_ATTEMPTS), Some("3"));
        // A request that is not a CloudEvent gets the headers too.
        let plain = dead_letter(&cause(&failure, b"", ""), &Forwarded::default(), b"plain");
        assert_eq!(plain.body, None);
        assert_eq!(plain.header("ce-knativeerrorcode"), Some("503"));
    }

    #[test]
    fn error_data_is_at_most_1024_bytes_before_base64() {
        let answer = vec![b'x'; 5000];
        let failure = status(500, "");
        let letter = dead_letter(&cause(&failure, &answer, ""), &binary(), b"");
        let data = decode(letter.header("ce-knativeerrordata").unwrap());
        assert_eq!(data, vec![b'x'; ERROR_DATA_BYTES]);
        // An empty answer is empty data.
        let letter = dead_letter(&cause(&failure, b"", ""), &binary(), b"");
        assert_eq!(letter.header("ce-knativeerrordata"), Some(""));
    }

    #[test]
    fn failures_without_a_status_get_knatives_code_and_the_detail_as_data() {
        let detail = "no answer within the timeout of 2000 ms";
        let cases = [
            (Failure::Timeout, "500"),
            (Failure::NoResponse, "500"),
            (
                Failure::Reset {
                    detail: "upstream connect error".into(),
                },
                "500",
            ),
            (
                Failure::DispatchError {
                    detail: "unknown cluster".into(),
                },
                "500",
            ),
            (
                Failure::TooLarge {
                    size: 2000,
                    limit: 1000,
                },
                "413",
            ),
        ];
        for (failure, code) in cases {
            let letter = dead_letter(&cause(&failure, b"envoy's body", detail), &binary(), b"");
            assert_eq!(
                letter.header("ce-knativeerrorcode"),
                Some(code),
                "{failure:?}"
            );
            let data = decode(letter.header("ce-knativeerrordata").unwrap());
            assert_eq!(data, detail.as_bytes(), "{failure:?}");
            assert_eq!(letter.header(DEAD_LETTER_STATUS), None);
            assert_eq!(
                letter.header(DEAD_LETTER_OUTCOME),
                Some(failure.kind()),
                "{failure:?}"
            );
        }
    }

    #[test]
    fn the_destination_is_percent_encoded_in_a_header() {
        let failure = status(404, "");
        let mut c = cause(&failure, b"", "");
        c.path = "/a%20b/\u{e9}\"q\"";
        let letter = dead_letter(&c, &binary(), b"");
        assert_eq!(
            letter.header("ce-knativeerrordest"),
            Some("http://billing.default.svc/a%2520b/%C3%A9%22q%22")
        );
        assert!(letter
            .headers
            .iter()
            .all(|(_, v)| crate::headers::is_valid_value(v)));
    }

    #[test]
    fn structured_mode_adds_members_at_the_end_of_the_object_byte_for_byte() {
        let failure = status(503, "");
        let event = b" {\"specversion\" : \"1.0\",\n \"id\":\"1\", \"data\": {\"n\": 1.50}}\n";
        let letter = dead_letter(&cause(&failure, b"down", ""), &structured(), event);
        let body = letter.body.clone().unwrap();
        let want = format!(
            " {{\"specversion\" : \"1.0\",\n \"id\":\"1\", \"data\": {{\"n\": 1.50}},\
             \"knativeerrordest\":\"http://billing.default.svc/events\",\
             \"knativeerrorcode\":503,\"knativeerrordata\":\"{}\"}}\n",
            base64::engine::general_purpose::STANDARD.encode("down")
        );
        assert_eq!(String::from_utf8(body).unwrap(), want);
        // No ce-* header: that would make an SDK read it as binary mode.
        assert!(!letter.headers.iter().any(|(n, _)| n.starts_with("ce-")));
        assert_eq!(letter.header(DEAD_LETTER_STATUS), Some("503"));
    }

    #[test]
    fn structured_members_are_escaped_json_and_an_empty_object_gets_no_comma() {
        let failure = status(500, "");
        let mut c = cause(&failure, b"", "");
        c.path = "/q\"\\";
        let letter = dead_letter(&c, &structured(), b"{ }");
        let body = letter.body.unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["knativeerrordest"], "http://billing.default.svc/q\"\\");
        assert_eq!(doc["knativeerrorcode"], 500);
        assert_eq!(doc["knativeerrordata"], "");
        assert!(body.starts_with(b"{ \"knativeerrordest\""));
    }

    #[test]
    fn a_member_already_in_the_event_is_overridden_by_the_added_one() {
        let failure = status(502, "");
        let event = br#"{"id":"1","knativeerrorcode":404}"#;
        let body = dead_letter(&cause(&failure, b"", ""), &structured(), event)
            .body
            .unwrap();
        assert!(body.starts_with(br#"{"id":"1","knativeerrorcode":404,"knativeerrordest""#));
        let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(doc["knativeerrorcode"], 502, "the last duplicate wins");
    }

    #[test]
    fn a_structured_body_that_is_not_one_object_is_passed_on_as_it_came() {
        let failure = status(500, "");
        for event in [
            &b"[1, 2]"[..],
            b"not json",
            b"{\"id\": 1} {}",
            b"",
            b"\"s\"",
        ] {
            let letter = dead_letter(&cause(&failure, b"", ""), &structured(), event);
            assert_eq!(letter.body, None, "{:?}", String::from_utf8_lossy(event));
            assert!(!letter.headers.iter().any(|(n, _)| n.starts_with("ce-")));
            assert_eq!(letter.header(DEAD_LETTER_OUTCOME), Some("status"));
        }
    }

    #[test]
    fn a_failed_reply_names_its_leg_and_destination() {
        let failure = Failure::TooLarge {
            size: 2000,
            limit: 1000,
        };
        let detail = failure.to_string();
        let mut c = cause(&failure, b"", &detail);
        c.leg = Leg::Reply;
        c.authority = "replies.local";
        c.path = "/in";
        let letter = dead_letter(&c, &binary(), b"");
        assert_eq!(letter.header(DEAD_LETTER_LEG), Some("reply"));
        assert_eq!(letter.header(DEAD_LETTER_OUTCOME), Some("too_large"));
        assert_eq!(letter.header(DEAD_LETTER_BODY), Some(detail.as_str()));
        assert_eq!(
            letter.header("ce-knativeerrordest"),
            Some("http://replies.local/in")
        );
    }

    #[test]
    fn only_the_attribute_headers_are_replaced() {
        assert!(replaces("ce-knativeerrordest"));
        assert!(replaces("ce-knativeerrorcode"));
        assert!(replaces("ce-knativeerrordata"));
        assert!(!replaces("ce-id"));
        assert!(!replaces(DEAD_LETTER_CLUSTER));
    }
}
