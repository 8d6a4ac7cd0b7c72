//! What the filter answers the sender with: 202, the 500 failure report, or a rejection
//! (400/404/405/413) that says what was wrong with the request.
//!
//! Answers are plain data; the stream hands them to Envoy as a local reply.

use serde::Serialize;

/// Content type of every answer with a body.
pub const JSON: &str = "application/json";
/// Header on a 500 from `fanout`, with the number of failed subscribers, so that a sender can
/// tell our answer from one Envoy made up.
pub const FAILED_HEADER: &str = "x-fanout-failed";
/// Header on an answer that skipped subscribers because `dedupe` recorded that they already
/// took the event: how many.
pub const ALREADY_DELIVERED_HEADER: &str = "x-fanout-already-delivered";
/// Header on an answer when some subscribers' events went to their dead-letter target.
pub const DEAD_LETTERED_HEADER: &str = "x-fanout-dead-lettered";
/// Header on an answer sent while best-effort subscribers were still being delivered to: how
/// many.
pub const PENDING_HEADER: &str = "x-fanout-pending";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

#[derive(Serialize)]
struct Rejection<'a> {
    error: &'a str,
}

impl Answer {
    /// Every subscriber accepted the event (or the channel has none).
    pub fn accepted() -> Answer {
        Answer {
            status: 202,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    /// A request the filter will not fan out: `{"error": message}`.
    pub fn rejected(status: u32, message: &str) -> Answer {
        Answer {
            status,
            headers: vec![("content-type", JSON.to_string())],
            body: to_json(&Rejection { error: message }),
        }
    }

    /// The 413 for a body over `max_body_bytes`, whether declared or counted.
    pub fn too_large(max_body_bytes: u64) -> Answer {
        Answer::rejected(
            413,
            &format!("the body is larger than max_body_bytes ({max_body_bytes} bytes)"),
        )
    }

    /// The plugin has no configuration it could accept: Envoy's log says why.
    pub fn no_configuration() -> Answer {
        Answer::rejected(500, "fanout has no valid configuration; see Envoy's log")
    }

    /// Admission picked a channel the configuration does not have: a bug, said as one.
    pub fn no_such_channel() -> Answer {
        Answer::rejected(500, "fanout: channel index out of range")
    }

    /// Async mode: this worker already holds `in_flight` events, its `max_in_flight`.
    pub fn busy(in_flight: usize) -> Answer {
        let message = format!(
            "fanout holds {in_flight} events in flight on this worker (max_in_flight); try \
             again later"
        );
        Answer::rejected(503, &message).with_header("retry-after", "1".into())
    }

    /// Async mode, `dedupe`: another request is delivering this event to `subscribers` of
    /// the channel's subscribers. The sender retries, and the retry is answered from the
    /// records.
    pub fn in_progress_elsewhere(subscribers: usize) -> Answer {
        Answer::rejected(
            409,
            &format!(
                "another request is delivering this event to {subscribers} subscriber(s); try \
                 again later"
            ),
        )
        .with_header("retry-after", "1".into())
    }

    pub fn with_header(mut self, name: &'static str, value: String) -> Answer {
        self.headers.push((name, value));
        self
    }

    /// A JSON document as the body, with its content type.
    pub fn json<T: Serialize>(status: u32, document: &T) -> Answer {
        Answer {
            status,
            headers: vec![("content-type", JSON.to_string())],
            body: to_json(document),
        }
    }

    /// The headers in the form proxy-wasm takes them.
    pub fn header_pairs(&self) -> Vec<(&str, &str)> {
        self.headers
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect()
    }
}

/// Serializing our own plain structs cannot fail; should it ever, an empty document is still
/// a valid answer and no reason to abort the VM.
fn to_json<T: Serialize>(document: &T) -> Vec<u8> {
    serde_json::to_vec(document).unwrap_or_default()
}

/// Text from a subscriber's answer, made safe to put in a report or a header value: valid
/// UTF-8, control characters replaced by spaces, at most `max` bytes (cut on a character
/// boundary, marked with `...`).
pub fn sanitize(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.trim().chars() {
        if out.len() + c.len_utf8() > max {
            out.push_str("...");
            break;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_is_an_empty_202() {
        let a = Answer::accepted();
        assert_eq!(a.status, 202);
        assert!(a.body.is_empty());
        assert!(a.headers.is_empty());
    }

    #[test]
    fn rejection_is_json_with_the_message() {
        let a =
            Answer::rejected(404, "no channel for host \"x\"").with_header("allow", "POST".into());
        assert_eq!(a.status, 404);
        let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(doc["error"], "no channel for host \"x\"");
        assert_eq!(
            a.header_pairs(),
            vec![("content-type", JSON), ("allow", "POST")]
        );
    }

    #[test]
    fn the_filters_own_answers() {
        let error = |a: &Answer| -> String {
            let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
            doc["error"].as_str().unwrap().to_string()
        };
        let cases = [
            (
                Answer::too_large(64),
                413,
                "the body is larger than max_body_bytes (64 bytes)",
            ),
            (
                Answer::no_configuration(),
                500,
                "fanout has no valid configuration; see Envoy's log",
            ),
            (
                Answer::no_such_channel(),
                500,
                "fanout: channel index out of range",
            ),
            (
                Answer::busy(3),
                503,
                "fanout holds 3 events in flight on this worker (max_in_flight); try again later",
            ),
            (
                Answer::in_progress_elsewhere(2),
                409,
                "another request is delivering this event to 2 subscriber(s); try again later",
            ),
        ];
        for (answer, status, message) in cases {
            assert_eq!((answer.status, error(&answer).as_str()), (status, message));
            let retry_after = answer.headers.contains(&("retry-after", "1".to_string()));
            assert_eq!(retry_after, status == 503 || status == 409, "{answer:?}");
        }
    }

    #[test]
    fn sanitize_table() {
        assert_eq!(sanitize(b"  plain text \n", 100), "plain text");
        assert_eq!(sanitize(b"a\r\nb\x00c", 100), "a  b c");
        assert_eq!(sanitize(b"\xff\xfeok", 100), "\u{fffd}\u{fffd}ok");
        assert_eq!(sanitize(b"abcdef", 3), "abc...");
        // never cuts inside a character
        assert_eq!(sanitize("ééé".as_bytes(), 3), "é...");
        assert_eq!(sanitize(b"", 10), "");
    }
}
