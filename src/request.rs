//! Admission of one request, from its headers: is it a fan-out, to which channel, with which
//! headers — or which rejection does it get.
//!
//! The checks run in the order a sender can act on them: method (405), host (404), declared
//! body size (413), the CloudEvents mode when the channel filters (415, 400), then header
//! values (400). Nothing here calls a subscriber.

use crate::answer::Answer;
use crate::cloudevents::{self, Attributes, EventError, Mode};
use crate::config::Config;
use crate::dedupe::MAX_KEY_BYTES;

/// A request that passed admission: the body still decides (it may turn out too large).
#[derive(Debug, PartialEq, Eq)]
pub struct Admitted {
    pub channel: usize,
    /// The request headers chosen by `forward_headers`, in the order they arrived.
    pub forwarded: Vec<(String, String)>,
    /// How the request carries its CloudEvent, read from the headers (binary attributes
    /// already decoded) only when a subscriber of the channel has a filter; `None` otherwise.
    pub event: Option<Mode>,
    /// The event's identity for `dedupe`: the value of its `key` header, when dedupe is on
    /// and the request has one that is not empty and at most `MAX_KEY_BYTES` long.
    pub event_key: Option<Vec<u8>>,
}

/// Decides on a request from its headers, as Envoy hands them over (lower-case names,
/// values as bytes). Takes the headers by value so the forwarded ones move, not copy.
pub fn admit(config: &Config, headers: Vec<(String, Vec<u8>)>) -> Result<Admitted, Answer> {
    let method = find(&headers, ":method").unwrap_or_default();
    if !config.methods.iter().any(|m| m.as_bytes() == method) {
        let message = format!(
            "method {} is not allowed: fanout accepts {}",
            String::from_utf8_lossy(method),
            config.allow
        );
        return Err(Answer::rejected(405, &message).with_header("allow", config.allow.clone()));
    }

    let authority = find(&headers, ":authority")
        .or_else(|| find(&headers, "host"))
        .unwrap_or_default();
    let authority = String::from_utf8_lossy(authority);
    let Some(channel) = config.router.route(&authority) else {
        return Err(Answer::rejected(
            404,
            &format!("no channel for host \"{authority}\""),
        ));
    };

    if let Some(length) = find(&headers, "content-length") {
        let declared = std::str::from_utf8(length)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        if let Some(declared) = declared {
            if declared > config.max_body_bytes {
                return Err(too_large(config.max_body_bytes));
            }
        }
    }

    // Read from the headers Envoy already gave us, before the forwarded ones move: no host call.
    let filtered = config.channel(channel).is_some_and(|c| c.filtered);
    let event = if filtered {
        Some(cloudevents::read_headers(&headers).map_err(|e| event_rejection(&e))?)
    } else {
        None
    };
    let event_key = config.dedupe.as_ref().and_then(|dedupe| {
        find(&headers, &dedupe.key)
            .filter(|key| !key.is_empty() && key.len() <= MAX_KEY_BYTES)
            .map(<[u8]>::to_vec)
    });

    let mut forwarded = Vec::new();
    for (name, value) in headers {
        if !config.forward.selects(&name) {
            continue;
        }
        match String::from_utf8(value) {
            Ok(value) => forwarded.push((name, value)),
            Err(_) => {
                return Err(Answer::rejected(
                    400,
                    &format!(
                        "header {name} has a value that is not UTF-8; fanout forwards only \
                         UTF-8 header values"
                    ),
                ))
            }
        }
    }
    Ok(Admitted {
        channel,
        forwarded,
        event,
        event_key,
    })
}

/// The attributes the channel's filters are matched against, once the body is complete:
/// `None` when the channel has no filters or the request is not a CloudEvent. A structured
/// body is parsed here, and only here.
pub fn event_attributes(event: Option<Mode>, body: &[u8]) -> Result<Option<Attributes>, Answer> {
    match event {
        None => Ok(None),
        Some(mode) => mode.attributes(body).map_err(|e| event_rejection(&e)),
    }
}

/// A batch or another event format cannot be filtered: 415. A malformed event: 400.
fn event_rejection(error: &EventError) -> Answer {
    let status = match error {
        EventError::Unsupported(_) => 415,
        EventError::Malformed(_) => 400,
    };
    Answer::rejected(status, &error.to_string())
}

/// The 413 for a body over `max_body_bytes`, whether declared or counted.
pub fn too_large(max_body_bytes: u64) -> Answer {
    Answer::rejected(
        413,
        &format!("the body is larger than max_body_bytes ({max_body_bytes} bytes)"),
    )
}

fn find<'h>(headers: &'h [(String, Vec<u8>)], name: &str) -> Option<&'h [u8]> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn config() -> Config {
        Config::from_json(
            br#"{"max_body_bytes": 100, "methods": ["POST", "PUT"],
                 "channels": [
                   {"name": "orders", "hosts": ["orders.default"], "subscribers": [{"cluster": "a"}]},
                   {"name": "payments", "hosts": ["payments.default"], "subscribers": []}
                 ]}"#,
        )
        .unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    fn status(result: Result<Admitted, Answer>) -> u32 {
        match result {
            Ok(_) => 0,
            Err(answer) => answer.status,
        }
    }

    #[test]
    fn admission_table() {
        let config = config();
        let cases: &[(&[(&str, &str)], u32)] = &[
            (&[(":method", "POST"), (":authority", "orders.default")], 0),
            (
                &[(":method", "PUT"), (":authority", "payments.default:80")],
                0,
            ),
            (&[(":method", "GET"), (":authority", "orders.default")], 405),
            (
                &[(":method", "post"), (":authority", "orders.default")],
                405,
            ),
            (&[(":authority", "orders.default")], 405),
            (
                &[(":method", "POST"), (":authority", "nobody.default")],
                404,
            ),
            (&[(":method", "POST")], 404),
            (&[(":method", "POST"), ("host", "Orders.Default")], 0),
            (
                &[
                    (":method", "POST"),
                    (":authority", "orders.default"),
                    ("content-length", "101"),
                ],
                413,
            ),
            (
                &[
                    (":method", "POST"),
                    (":authority", "orders.default"),
                    ("content-length", "100"),
                ],
                0,
            ),
            // a method check comes before the host check
            (&[(":method", "GET"), (":authority", "nobody")], 405),
        ];
        for (pairs, want) in cases {
            assert_eq!(status(admit(&config, headers(pairs))), *want, "{pairs:?}");
        }
    }

    #[test]
    fn routes_to_the_channel_of_the_host() {
        let config = config();
        let admitted = admit(
            &config,
            headers(&[(":method", "POST"), (":authority", "PAYMENTS.default:8080")]),
        )
        .unwrap();
        assert_eq!(admitted.channel, 1);
    }

    #[test]
    fn forwards_only_selected_headers_in_order() {
        let config = config();
        let admitted = admit(
            &config,
            headers(&[
                (":method", "POST"),
                (":authority", "orders.default"),
                (":path", "/"),
                ("content-type", "application/json"),
                ("authorization", "Bearer secret"),
                ("cookie", "a=b"),
                ("ce-id", "1"),
                ("x-unlisted", "no"),
                ("content-length", "2"),
                ("x-request-id", "r1"),
            ]),
        )
        .unwrap();
        assert_eq!(
            admitted.forwarded,
            vec![
                ("content-type".to_string(), "application/json".to_string()),
                ("ce-id".to_string(), "1".to_string()),
                ("x-request-id".to_string(), "r1".to_string()),
            ]
        );
    }

    fn filtered_config() -> Config {
        Config::from_json(
            br#"{"channels": [
                   {"name": "filtered", "hosts": ["f"], "subscribers": [
                     {"cluster": "a", "filters": [{"exact": {"type": "t"}}]}, {"cluster": "b"}]},
                   {"name": "plain", "hosts": ["p"], "subscribers": [{"cluster": "c"}]}
                 ]}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_event_mode_is_read_only_when_the_channel_filters() {
        let config = filtered_config();
        let request = |host: &str, extra: &[(&str, &str)]| {
            let mut h = headers(&[(":method", "POST"), (":authority", host)]);
            h.extend(headers(extra));
            admit(&config, h)
        };
        let binary = request("f", &[("ce-type", "t%21"), ("ce-id", "1")]).unwrap();
        assert_eq!(
            binary.event,
            Some(Mode::Binary(Attributes::from([
                ("type", "t!"),
                ("id", "1")
            ])))
        );
        let structured = request("f", &[("content-type", "application/cloudevents+json")]).unwrap();
        assert_eq!(structured.event, Some(Mode::Structured));
        assert_eq!(request("f", &[]).unwrap().event, Some(Mode::NotCloudEvent));
        // A channel without filters never looks: no mode, no 415, no 400.
        assert_eq!(request("p", &[("ce-type", "t")]).unwrap().event, None);
        let batch = [("content-type", "application/cloudevents-batch+json")];
        assert!(request("p", &batch).is_ok());
        assert!(request("p", &[("ce-type", "t"), ("ce-id", "%ff")]).is_ok());

        let answer = request("f", &batch).unwrap_err();
        assert_eq!(answer.status, 415);
        assert!(String::from_utf8(answer.body).unwrap().contains("batch"));
        let answer = request("f", &[("ce-type", "t"), ("ce-id", "%ff")]).unwrap_err();
        assert_eq!(answer.status, 400);
        assert!(String::from_utf8(answer.body).unwrap().contains("ce-id"));
    }

    #[test]
    fn event_attributes_parse_a_structured_body_or_answer_400() {
        assert_eq!(event_attributes(None, b"{not json"), Ok(None));
        assert_eq!(
            event_attributes(Some(Mode::Structured), br#"{"type": "t", "data": {}}"#),
            Ok(Some(Attributes::from([("type", "t")])))
        );
        let answer = event_attributes(Some(Mode::Structured), b"{not json").unwrap_err();
        assert_eq!(answer.status, 400);
    }

    #[test]
    fn the_dedupe_key_is_taken_only_when_dedupe_is_on() {
        let h = |key: &str| {
            headers(&[
                (":method", "POST"),
                (":authority", "x"),
                ("x-event", key),
                ("ce-id", "c1"),
            ])
        };
        let off = Config::from_json(br#"{"subscribers": []}"#).unwrap();
        assert_eq!(admit(&off, h("e1")).unwrap().event_key, None);
        let on =
            Config::from_json(br#"{"dedupe": {"key": "X-Event"}, "subscribers": []}"#).unwrap();
        assert_eq!(admit(&on, h("e1")).unwrap().event_key, Some(b"e1".to_vec()));
        assert_eq!(admit(&on, h("")).unwrap().event_key, None);
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        assert_eq!(admit(&on, h(&long)).unwrap().event_key, None);
        let default_key = Config::from_json(br#"{"dedupe": {}, "subscribers": []}"#).unwrap();
        assert_eq!(
            admit(&default_key, h("e1")).unwrap().event_key,
            Some(b"c1".to_vec())
        );
    }

    #[test]
    fn method_not_allowed_lists_the_allowed_ones() {
        let answer = admit(
            &config(),
            headers(&[(":method", "GET"), (":authority", "orders.default")]),
        )
        .unwrap_err();
        assert!(answer.headers.contains(&("allow", "POST, PUT".to_string())));
        let text = String::from_utf8(answer.body).unwrap();
        assert!(text.contains("method GET is not allowed"), "{text}");
    }

    #[test]
    fn unknown_host_is_named_in_the_404() {
        let answer = admit(
            &config(),
            headers(&[(":method", "POST"), (":authority", "nobody.default")]),
        )
        .unwrap_err();
        let text = String::from_utf8(answer.body).unwrap();
        assert!(text.contains("nobody.default"), "{text}");
    }

    #[test]
    fn a_forwarded_header_that_is_not_utf8_is_a_400_naming_it() {
        let mut h = headers(&[(":method", "POST"), (":authority", "orders.default")]);
        h.push(("ce-source".to_string(), vec![0xff, 0xfe]));
        let answer = admit(&config(), h).unwrap_err();
        assert_eq!(answer.status, 400);
        assert!(String::from_utf8(answer.body)
            .unwrap()
            .contains("ce-source"));
        // ...but one that is not forwarded does not matter.
        let mut h = headers(&[(":method", "POST"), (":authority", "orders.default")]);
        h.push(("x-unlisted".to_string(), vec![0xff]));
        assert!(admit(&config(), h).is_ok());
    }
}
