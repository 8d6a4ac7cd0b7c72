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
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

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
