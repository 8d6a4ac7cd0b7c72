//! Replies (Knative's data plane): `Prefer: reply`, which answers are reply events, how a
//! reply is passed on, and a reply that fails.

use super::*;

/// The headers of a binary-mode reply event: its required attributes.
const REPLY: &[(&str, &str)] = &[
    ("ce-specversion", "1.0"),
    ("ce-id", "r-1"),
    ("ce-source", "/a"),
    ("ce-type", "com.example.reply"),
];

#[test]
fn a_reply_is_forwarded_with_its_content_type_and_ce_headers() {
    let plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "replies", "path": "/in"}}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    {
        let mut state = plugin.host.0.borrow_mut();
        state.call_response = (Some(200), b"{\"answer\": 1}".to_vec());
        state.call_response_headers = vec![
            (":status".into(), b"200".to_vec()),
            ("content-type".into(), b"application/json".to_vec()),
            ("ce-specversion".into(), b"1.0".to_vec()),
            ("ce-id".into(), b"r-1".to_vec()),
            ("ce-source".into(), b"/a".to_vec()),
            ("ce-type".into(), b"com.example.reply".to_vec()),
            ("set-cookie".into(), b"secret".to_vec()),
        ];
    }
    ctx.on_call_response(plugin.host.token_of("a"), 4, 13);
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(reply.body, b"{\"answer\": 1}");
    assert_eq!(reply.header("content-type"), Some(&b"application/json"[..]));
    assert_eq!(reply.header("ce-type"), Some(&b"com.example.reply"[..]));
    assert!(!reply.headers.iter().any(|(n, _)| n == "set-cookie"));
    assert!(
        plugin.answers().is_empty(),
        "answered before the reply was delivered"
    );
    plugin.answer_call(&mut ctx, reply.token, Some(500), "");
    assert_eq!(
        plugin.only_answer().status,
        500,
        "a failed reply is a failed delivery"
    );
}

#[test]
fn prefer_reply_goes_only_to_subscribers_with_a_reply_target() {
    let plugin = FakeEnvoy::configured(REPLYING);
    let _ctx = send(&plugin, &post("x"), b"event");
    let calls = plugin.state().dispatched.clone();
    assert_eq!(header_of(&calls[0], "prefer").as_deref(), Some("reply"));
    assert_eq!(header_of(&calls[1], "prefer"), None);
}

#[test]
fn a_202_is_never_a_reply_and_nothing_of_it_is_read() {
    let plugin = FakeEnvoy::configured(REPLYING);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer(&mut ctx, "plain", Some(200), "");
    plugin.answer_with(
        &mut ctx,
        "answering",
        202,
        &[("ce-type", "com.example.reply"), ("ce-id", "r")],
        b"{\"looks\": \"like an event\"}",
    );
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(plugin.state().dispatched.len(), 2, "a reply was sent");
    assert_eq!(plugin.state().call_body_reads, 0);
}

#[test]
fn a_2xx_body_that_is_not_a_cloudevent_is_discarded_and_counted() {
    let mut plugin = FakeEnvoy::configured(REPLYING);
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_discarded"),
        0
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer(&mut ctx, "plain", Some(200), "");
    plugin.answer_with(
        &mut ctx,
        "answering",
        200,
        &[("content-type", "application/json")],
        b"{\"ok\": true}",
    );
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(plugin.state().dispatched.len(), 2, "a reply was sent");
    assert_eq!(plugin.state().call_body_reads, 0, "the body was read");
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_discarded"),
        1
    );
    // A subscriber without a reply target has no reply counters.
    assert!(plugin
        .state()
        .metric("fanout.subscriber.plain.reply_discarded")
        .is_none());
}

#[test]
fn an_answer_that_looks_like_an_event_but_is_not_a_valid_one_is_discarded_and_counted() {
    // An empty 200 with only a ce-* header, a binary event without ce-specversion, a batch:
    // none of them is one valid CloudEvent, so none is passed on as a reply.
    type HeadersAndBody<'a> = (&'a [(&'a str, &'a str)], &'a [u8]);
    let not_events: [HeadersAndBody; 3] = [
        (&[("ce-abc", "x")], b""),
        (
            &[("ce-id", "1"), ("ce-source", "/a"), ("ce-type", "t")],
            b"{}",
        ),
        (
            &[("content-type", "application/cloudevents-batch+json")],
            b"[]",
        ),
    ];
    for (i, (headers, body)) in not_events.into_iter().enumerate() {
        let mut plugin = FakeEnvoy::configured(REPLYING);
        let mut ctx = send(&plugin, &post("x"), b"event");
        plugin.answer(&mut ctx, "plain", Some(200), "");
        plugin.answer_with(&mut ctx, "answering", 200, headers, body);
        assert_eq!(plugin.only_answer(), Answer::accepted(), "{i}");
        assert_eq!(plugin.state().dispatched.len(), 2, "{i}: a reply was sent");
        assert_eq!(
            plugin.flushed("fanout.subscriber.answering.reply_discarded"),
            1,
            "{i}"
        );
    }
}

#[test]
fn a_structured_reply_is_passed_on_whole_at_the_limit() {
    let plugin = FakeEnvoy::configured(REPLYING);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer(&mut ctx, "plain", Some(200), "");
    let body = [b'x'; 64];
    plugin.answer_with(
        &mut ctx,
        "answering",
        200,
        &[("content-type", "application/cloudevents+json")],
        &body,
    );
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(reply.body, body);
    assert_eq!(header_of(&reply, "prefer"), None);
}

#[test]
fn a_reply_over_max_body_bytes_is_a_failed_reply_never_read_nor_sent_cut_short() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"max_body_bytes": 64,
            "subscribers": [{"cluster": "answering", "reply": {"cluster": "replies"}}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.host.0.borrow_mut().now_ms = 9;
    plugin.answer_with(&mut ctx, "answering", 200, REPLY, &[b'x'; 65]);
    assert_eq!(plugin.state().dispatched.len(), 1, "a reply was sent");
    assert_eq!(plugin.state().call_body_reads, 0, "the body was read");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    let failed = &report(&answer)["failed"][0];
    assert_eq!(failed["cluster"], "answering");
    assert_eq!(failed["leg"], "reply");
    assert_eq!(failed["outcome"], "too_large");
    assert_eq!(
        failed["detail"],
        "the reply of 65 bytes is larger than max_body_bytes (64): not passed on"
    );
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_failed.too_large"),
        1
    );
    // The subscriber's own call succeeded.
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.answering.delivered"),
        1
    );
}

#[test]
fn a_reply_target_envoy_refuses_is_a_failed_reply_counted_by_its_reason() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "answering", "reply": {"cluster": "replies"}}]}"#,
    );
    plugin
        .host
        .0
        .borrow_mut()
        .unknown_clusters
        .insert("replies".into());
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_with(&mut ctx, "answering", 200, REPLY, b"answer");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    let failed = &report(&answer)["failed"][0];
    assert_eq!(failed["leg"], "reply");
    assert_eq!(failed["outcome"], "dispatch_error");
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_failed.dispatch_error"),
        1
    );
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.replies.failed.dispatch_error"),
        1
    );
}

#[test]
fn a_reply_that_failed_for_good_sends_the_original_event_to_the_dead_letter() {
    let mut plugin = FakeEnvoy::configured(REPLYING);
    let mut headers = post("x");
    headers.extend([("ce-id", "7"), ("ce-knativeerrorcode", "999")]);
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer(&mut ctx, "plain", Some(200), "");
    plugin.answer_with(&mut ctx, "answering", 200, REPLY, b"answer");
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    plugin.answer_call_with(&mut ctx, reply.token, 503, &[], b"replies down");
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    assert_eq!(dlq.body, b"event", "the original event, not the reply");
    assert_eq!(header_of(&dlq, "ce-id").as_deref(), Some("7"));
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-cluster").as_deref(),
        Some("answering")
    );
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-leg").as_deref(),
        Some("reply")
    );
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-status").as_deref(),
        Some("503")
    );
    assert_eq!(
        header_of(&dlq, "ce-knativeerrordest").as_deref(),
        Some("http://replies.local/replies")
    );
    // The request's own attribute of that name gives way to the dead letter's.
    assert_eq!(
        dlq.headers
            .iter()
            .filter(|(n, _)| n == "ce-knativeerrorcode")
            .map(|(_, v)| v.as_slice())
            .collect::<Vec<_>>(),
        [b"503"]
    );
    assert_eq!(
        header_of(&dlq, "ce-knativeerrordata").as_deref(),
        Some("cmVwbGllcyBkb3du"),
        "base64 of the reply target's answer"
    );
    plugin.answer_call(&mut ctx, dlq.token, Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert!(answer
        .headers
        .contains(&("x-fanout-dead-lettered", "1".to_string())));
    assert_eq!(
        plugin.flushed("fanout.subscriber.answering.reply_failed.status_5xx"),
        1
    );
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.answering.dead_lettered"),
        1
    );
}
