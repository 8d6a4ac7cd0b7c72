//! Header values byte for byte: a value nobody reads (raw latin1 from a CloudEvents SDK that
//! does not percent-encode) reaches every subscriber, its dead letter and a reply target as it
//! came; a value fanout must read (routing, a filter's attribute, the dedupe identity,
//! `require_cloudevents`, `content-type`) is read by the CloudEvents HTTP binding's rule, and
//! one that cannot be read is a 400 naming the header, before anyone is called.

use super::*;

/// `grüße aus Köln` as Node writes a JS string into a header: latin1, one byte a character.
const LATIN1: &[u8] = b"gr\xfc\xdfe aus K\xf6ln";

/// A binary event with the latin1 extension `greeting`.
fn greeting_event(host: &'static str) -> Vec<(String, Vec<u8>)> {
    let mut headers: Vec<(String, Vec<u8>)> = with(
        host,
        &[
            ("ce-specversion", "1.0"),
            ("ce-id", "1"),
            ("ce-source", "/s"),
            ("ce-type", "t"),
            ("content-type", "text/plain"),
        ],
    )
    .into_iter()
    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
    .collect();
    headers.push(("ce-greeting".to_string(), LATIN1.to_vec()));
    headers
}

/// Sends `headers` (values as bytes) with a body; returns the stream.
fn send_bytes(
    plugin: &FakeEnvoy,
    headers: Vec<(String, Vec<u8>)>,
    body: &[u8],
) -> Stream<FakeHost> {
    let mut ctx = plugin.stream(&[], body);
    plugin.host.0.borrow_mut().request_headers = headers;
    assert_eq!(ctx.on_request_headers(false), Flow::Pause);
    ctx.on_request_body(body.len(), true);
    ctx
}

/// The one answer, a 400 whose error names `header`; nobody was called.
fn refused_naming(plugin: &FakeEnvoy, header: &str) {
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 400, "{answer:?}");
    let error = report(&answer)["error"].as_str().unwrap().to_string();
    assert!(error.contains(header), "{error}");
    assert!(plugin.state().dispatched.is_empty());
}

#[test]
fn a_latin1_value_reaches_every_subscriber_and_the_dead_letter_byte_for_byte() {
    let plugin = FakeEnvoy::configured(
        r#"{"delivery": {"dead_letter": {"cluster": "dlq"}},
            "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#,
    );
    let mut ctx = send_bytes(&plugin, greeting_event("x"), b"hello");
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 2);
    for call in &calls {
        assert_eq!(call.header("ce-greeting"), Some(LATIN1), "{}", call.cluster);
        assert_eq!(call.header("ce-id"), Some(&b"1"[..]));
    }
    plugin.answer(&mut ctx, "a", Some(202), "");
    plugin.answer(&mut ctx, "b", Some(500), "down");
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    assert_eq!(dlq.header("ce-greeting"), Some(LATIN1));
    assert_eq!(dlq.header("ce-knativeerrorcode"), Some(&b"500"[..]));
    plugin.answer_call(&mut ctx, dlq.token, Some(202), "");
    assert_eq!(plugin.only_answer().status, 202);
}

#[test]
fn a_reply_carries_its_latin1_extension_byte_for_byte() {
    let plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "replies"}}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    {
        let mut state = plugin.host.0.borrow_mut();
        state.call_response = (Some(200), b"r".to_vec());
        state.call_response_headers = vec![
            (":status".into(), b"200".to_vec()),
            ("ce-specversion".into(), b"1.0".to_vec()),
            ("ce-id".into(), b"r-1".to_vec()),
            ("ce-source".into(), b"/a".to_vec()),
            ("ce-type".into(), b"reply".to_vec()),
            ("ce-greeting".into(), LATIN1.to_vec()),
        ];
    }
    ctx.on_call_response(plugin.host.token_of("a"), 6, 1);
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(reply.header("ce-greeting"), Some(LATIN1));
}

#[test]
fn a_filter_that_does_not_read_the_value_lets_it_through() {
    let plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"type": "t"}}]}]}"#,
    );
    let mut ctx = send_bytes(&plugin, greeting_event("x"), b"hello");
    assert_eq!(plugin.last_call().header("ce-greeting"), Some(LATIN1));
    plugin.answer(&mut ctx, "a", Some(202), "");
    assert_eq!(plugin.only_answer().status, 202);
}

#[test]
fn a_filter_that_reads_the_value_refuses_it_naming_the_header() {
    for filter in [
        r#"{"exact": {"greeting": "hallo"}}"#,
        r#"{"not": {"prefix": {"greeting": "g"}}}"#,
        r#"{"any": [{"exact": {"type": "x"}}, {"suffix": {"greeting": "n"}}]}"#,
    ] {
        let plugin = FakeEnvoy::configured(&format!(
            r#"{{"subscribers": [{{"cluster": "a", "filters": [{filter}]}}, {{"cluster": "b"}}]}}"#
        ));
        let _ctx = send_bytes(&plugin, greeting_event("x"), b"hello");
        refused_naming(&plugin, "ce-greeting");
    }
}

#[test]
fn require_cloudevents_refuses_an_attribute_it_cannot_read() {
    let plugin = FakeEnvoy::configured(
        r#"{"require_cloudevents": true, "subscribers": [{"cluster": "a"}]}"#,
    );
    let _ctx = send_bytes(&plugin, greeting_event("x"), b"hello");
    refused_naming(&plugin, "ce-greeting");
    // Percent-encoded UTF-8, as the binding says, is an attribute like any other.
    let plugin = FakeEnvoy::configured(
        r#"{"require_cloudevents": true, "subscribers": [{"cluster": "a"}]}"#,
    );
    let mut headers = greeting_event("x");
    headers.last_mut().unwrap().1 = b"gr%C3%BC%C3%9Fe".to_vec();
    let mut ctx = send_bytes(&plugin, headers, b"hello");
    assert_eq!(
        plugin.last_call().header("ce-greeting"),
        Some(&b"gr%C3%BC%C3%9Fe"[..])
    );
    plugin.answer(&mut ctx, "a", Some(202), "");
    assert_eq!(plugin.only_answer().status, 202);
}

#[test]
fn the_dedupe_identity_must_be_readable() {
    for (config, header) in [
        (dedupe_by_identity(), "ce-id"),
        (dedupe_by_identity(), "ce-source"),
        (DEDUPE.to_string(), "ce-id"),
    ] {
        let plugin = FakeEnvoy::configured(&config);
        let mut headers = greeting_event("orders.default");
        for (name, value) in headers.iter_mut() {
            if name == header {
                *value = LATIN1.to_vec();
            }
        }
        let _ctx = send_bytes(&plugin, headers, b"e");
        refused_naming(&plugin, header);
    }
    // With dedupe off, the same identity is only carried.
    let plugin = FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a"}]}"#);
    let mut headers = greeting_event("x");
    headers[4].1 = LATIN1.to_vec();
    assert_eq!(headers[4].0, "ce-id");
    let _ctx = send_bytes(&plugin, headers, b"e");
    assert_eq!(plugin.last_call().header("ce-id"), Some(LATIN1));
}

#[test]
fn routing_and_the_content_type_must_be_readable_where_they_are_read() {
    let plugin = FakeEnvoy::configured(THREE);
    let mut headers = greeting_event("x");
    headers[1].1 = b"orders.default\xe9".to_vec();
    let _ctx = send_bytes(&plugin, headers, b"e");
    refused_naming(&plugin, ":authority");

    let filtered = r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"type": "t"}}]}]}"#;
    let plugin = FakeEnvoy::configured(filtered);
    let mut headers = greeting_event("x");
    headers[7].1 = b"text/plain; charset=latin1; name=K\xf6ln".to_vec();
    assert_eq!(headers[7].0, "content-type");
    let _ctx = send_bytes(&plugin, headers.clone(), b"e");
    refused_naming(&plugin, "content-type");
    // Where nothing reads it, it is carried.
    let plugin = FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a"}]}"#);
    let _ctx = send_bytes(&plugin, headers, b"e");
    assert_eq!(
        plugin.last_call().header("content-type"),
        Some(&b"text/plain; charset=latin1; name=K\xf6ln"[..])
    );
}

#[test]
fn a_value_that_would_split_the_header_block_is_refused_not_forwarded() {
    for bad in [&b"a\r\nx-evil: 1"[..], b"a\0b"] {
        let plugin = FakeEnvoy::configured(THREE);
        let mut headers = greeting_event("orders.default");
        headers.push(("x-request-id".into(), bad.to_vec()));
        let _ctx = send_bytes(&plugin, headers, b"e");
        refused_naming(&plugin, "x-request-id");
    }
}
