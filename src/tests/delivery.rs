//! Delivery: one call per subscriber and the 202 or 500 when they end; retries, dead
//! letters, replies (Knative's data plane), async mode, calls that never come back.

use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

// One call per subscriber, POST, its path and authority, the body, the selected
// headers, its own headers.
#[test]
fn every_subscriber_gets_one_call_with_body_and_headers() {
    let plugin = FakeEnvoy::configured(THREE);
    let mut headers = post("orders.default:8080");
    headers.extend([
        ("content-type", "application/json"),
        ("ce-id", "42"),
        ("authorization", "Bearer secret"),
        ("cookie", "a=b"),
        ("x-unlisted", "1"),
        ("content-length", "11"),
        ("x-request-id", "r-1"),
    ]);
    let _ctx = send(&plugin, &headers, b"{\"id\": 42}\n");
    let state = plugin.state();
    assert!(state.answers.is_empty(), "answered before the calls ended");
    let calls = &state.dispatched;
    assert_eq!(
        calls.iter().map(|c| c.cluster.as_str()).collect::<Vec<_>>(),
        ["billing", "shipping", "analytics"]
    );
    let forwarded = [
        ("content-type", "application/json"),
        ("ce-id", "42"),
        ("x-request-id", "r-1"),
    ];
    let expect = |path: &str, authority: &str, extra: &[(&str, &str)]| {
        let mut h: Vec<(String, String)> = vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            (":authority".into(), authority.into()),
        ];
        h.extend(
            extra
                .iter()
                .chain(&forwarded)
                .map(|(n, v)| (n.to_string(), v.to_string())),
        );
        h
    };
    assert_eq!(
        calls[0].headers,
        expect("/events", "billing.local", &[("x-tenant", "acme")])
    );
    assert_eq!(calls[1].headers, expect("/", "shipping", &[]));
    assert_eq!(calls[2].headers, expect("/in", "analytics", &[]));
    for call in calls {
        assert_eq!(call.body, b"{\"id\": 42}\n");
    }
    assert_eq!(calls[0].timeout, Duration::from_millis(2000));
    assert_eq!(calls[1].timeout, Duration::from_millis(60_000));
}

// The answer waits for every call; all 2xx gives 202.
#[test]
fn all_subscribers_2xx_answers_202_after_the_last() {
    let plugin = FakeEnvoy::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    plugin.answer_call(&mut ctx, 1, Some(204), "");
    assert!(plugin.answers().is_empty());
    plugin.answer_call(&mut ctx, 3, Some(202), "ignored body");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // Successes cost no read of the answer's body.
    assert_eq!(plugin.state().call_body_reads, 0);
}

// Any failure gives 500 with a report; the others are still called.
#[test]
fn one_failure_answers_500_naming_it() {
    let plugin = FakeEnvoy::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.host.0.borrow_mut().now_ms = 0;
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 35;
    plugin.answer_call(&mut ctx, 2, Some(500), "database down\r\n");
    plugin.answer_call(&mut ctx, 3, Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(answer
        .headers
        .contains(&("x-fanout-failed", "1".to_string())));
    let doc = report(&answer);
    assert_eq!(doc["channel"], "orders");
    assert_eq!(doc["delivered"], 2);
    let failed = &doc["failed"][0];
    assert_eq!(failed["cluster"], "shipping");
    assert_eq!(failed["outcome"], "status");
    assert_eq!(failed["status"], 500);
    assert_eq!(failed["detail"], "database down");
    assert_eq!(failed["elapsed_ms"], 35);
}

#[test]
fn outcome_kinds_in_the_report() {
    let cases: &[(Option<u16>, &str, &str)] = &[
        (Some(504), "upstream request timeout", "timeout"),
        (
            Some(503),
            "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
            "reset",
        ),
        (None, "", "no_response"),
        (Some(404), "", "status"),
        (Some(302), "", "status"),
    ];
    for (status, body, outcome) in cases {
        let plugin = FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a"}]}"#);
        let mut ctx = send(&plugin, &post("x"), b"e");
        plugin.answer_call(&mut ctx, 1, *status, body);
        let answer = plugin.only_answer();
        assert_eq!(answer.status, 500, "{status:?} {body}");
        assert_eq!(
            report(&answer)["failed"][0]["outcome"],
            *outcome,
            "{status:?} {body}"
        );
    }
}

// A call Envoy refuses counts at once; if all are refused the answer is immediate.
#[test]
fn unknown_cluster_fails_at_dispatch_and_others_are_still_called() {
    let plugin = FakeEnvoy::configured(THREE);
    plugin
        .host
        .0
        .borrow_mut()
        .unknown_clusters
        .insert("shipping".into());
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 2);
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    let doc = report(&plugin.only_answer());
    assert_eq!(doc["failed"][0]["cluster"], "shipping");
    assert_eq!(doc["failed"][0]["outcome"], "dispatch_error");
    assert_eq!(doc["failed"][0]["detail"], "unknown cluster shipping");
}

#[test]
fn every_call_refused_answers_500_at_once() {
    let plugin = FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#);
    {
        let mut state = plugin.host.0.borrow_mut();
        state.unknown_clusters.insert("a".into());
        state.unknown_clusters.insert("b".into());
    }
    let _ctx = send(&plugin, &post("x"), b"e");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(answer
        .headers
        .contains(&("x-fanout-failed", "2".to_string())));
}

#[test]
fn no_subscribers_answers_202_at_once() {
    let plugin = FakeEnvoy::configured(THREE);
    let _ctx = send(&plugin, &post("empty.default"), b"{}");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert!(plugin.state().dispatched.is_empty());
}

// Answered once; late, duplicate and unknown callbacks are ignored.
#[test]
fn late_duplicate_and_unknown_callbacks_change_nothing() {
    let plugin = FakeEnvoy::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.answer_call(&mut ctx, 99, Some(500), "stranger");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 1, Some(500), "duplicate");
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer_call(&mut ctx, 3, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    plugin.answer_call(&mut ctx, 3, Some(500), "late");
    plugin.answer_call(&mut ctx, 2, None, "");
    assert_eq!(plugin.answers().len(), 1);
    assert_eq!(ctx.on_request_body(10, true), Flow::Pause);
    assert_eq!(plugin.answers().len(), 1);
}

// A client that goes away leaves other streams alone.
#[test]
fn a_stream_that_ends_early_does_not_disturb_another() {
    let plugin = FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a"}]}"#);
    let mut first = send(&plugin, &post("x"), b"1");
    let mut second = send(&plugin, &post("x"), b"2");
    assert!(first.on_done());
    drop(first);
    plugin.answer_call(&mut second, 2, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn a_sync_retry_goes_out_from_the_root_after_its_backoff_and_the_root_answers_the_stream() {
    let mut plugin = FakeEnvoy::configured(RETRY_TWICE);
    assert_eq!(plugin.state().tick_period, Some(Duration::from_millis(10)));
    let mut ctx = send(&plugin, &post("x"), b"event");
    // First attempts from the stream.
    assert!(plugin
        .state()
        .dispatched
        .iter()
        .all(|c| c.context == STREAM));
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 5;
    plugin.answer_call(&mut ctx, 2, Some(503), "busy");
    assert!(plugin.answers().is_empty());
    plugin.tick_at(104);
    assert_eq!(
        plugin.state().dispatched.len(),
        2,
        "retried before its backoff"
    );
    plugin.tick_at(105);
    let retry = plugin.last_call();
    assert_eq!((retry.cluster.as_str(), retry.context), ("b", ROOT));
    assert_eq!(retry.body, b"event");
    plugin.answer_root_call(retry.token, Some(200), "", &[]);
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(plugin.state().answered_streams, vec![STREAM]);
    // The root put its own context back for whatever it does next.
    assert_eq!(plugin.state().effective, ROOT);
    // Our own answer passing through the stream is not mistaken for somebody else's.
    assert_eq!(ctx.on_response_headers(), Flow::Continue);
    plugin.tick_at(1000);
    assert_eq!(plugin.state().value("fanout.subscriber.b.retries"), 1);
    assert_eq!(plugin.state().value("fanout.requests.accepted"), 1);
}

#[test]
fn the_sender_leaving_during_a_retry_wait_drops_the_fan_out() {
    let mut plugin = FakeEnvoy::configured(RETRY_TWICE);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(503), "");
    assert!(ctx.on_done());
    plugin.host.0.borrow_mut().gone.insert(STREAM);
    plugin.tick_at(10_000);
    assert_eq!(
        plugin.state().dispatched.len(),
        2,
        "retried for a sender that left"
    );
    assert!(plugin.answers().is_empty());
}

#[test]
fn retries_run_out_into_a_500_with_the_attempts() {
    let mut plugin = FakeEnvoy::configured(RETRY_TWICE);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(500), "");
    plugin.tick_at(100);
    plugin.answer_root_call(plugin.last_call().token, None, "", &[]);
    plugin.tick_at(300);
    plugin.answer_root_call(plugin.last_call().token, Some(502), "still down", &[]);
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    let failed = &report(&answer)["failed"][0];
    assert_eq!(failed["cluster"], "b");
    assert_eq!(failed["attempts"], 3);
    assert_eq!(failed["status"], 502);
}

#[test]
fn a_400_is_not_retried() {
    let mut plugin = FakeEnvoy::configured(RETRY_TWICE);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(400), "bad event");
    assert_eq!(plugin.only_answer().status, 500);
    plugin.tick_at(10_000);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn retry_after_is_read_and_honoured() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"delivery": {"retry": 1, "backoff_delay_ms": 1, "backoff_max_ms": 60000},
            "subscribers": [{"cluster": "a"}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"event");
    {
        let mut state = plugin.host.0.borrow_mut();
        state.call_response = (Some(429), Vec::new());
        state.call_response_headers = vec![("retry-after".into(), b"2".to_vec())];
    }
    ctx.on_call_response(1, 2, 0);
    plugin.tick_at(1999);
    assert_eq!(plugin.state().dispatched.len(), 1);
    plugin.tick_at(2000);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn a_failed_subscriber_is_dead_lettered_with_the_failure_headers() {
    let plugin = FakeEnvoy::configured(WITH_DEAD_LETTER);
    let mut headers = post("x");
    headers.push(("ce-id", "7"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(&mut ctx, 1, Some(500), "db\ndown");
    // The dead letter goes out at once, from the stream.
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    assert_eq!(dlq.body, b"event");
    let header = |name: &str| {
        dlq.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header(":path").as_deref(), Some("/dead"));
    assert_eq!(header(":authority").as_deref(), Some("dlq.local"));
    assert_eq!(header("ce-id").as_deref(), Some("7"));
    assert_eq!(header("x-fanout-failed-cluster").as_deref(), Some("a"));
    assert_eq!(header("x-fanout-failed-status").as_deref(), Some("500"));
    assert_eq!(header("x-fanout-failed-body").as_deref(), Some("db down"));
    plugin.answer_call(&mut ctx, dlq.token, Some(202), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert!(answer
        .headers
        .contains(&("x-fanout-dead-lettered", "1".to_string())));
}

#[test]
fn a_failing_dead_letter_is_a_500() {
    let plugin = FakeEnvoy::configured(WITH_DEAD_LETTER);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(&mut ctx, 1, Some(500), "");
    plugin.answer_call(&mut ctx, 2, Some(503), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert_eq!(report(&answer)["failed"][0]["leg"], "dead_letter");
}

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
            ("ce-type".into(), b"com.example.reply".to_vec()),
            ("set-cookie".into(), b"secret".to_vec()),
        ];
    }
    ctx.on_call_response(1, 4, 13);
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(reply.body, b"{\"answer\": 1}");
    assert!(reply
        .headers
        .contains(&("content-type".to_string(), "application/json".to_string())));
    assert!(reply
        .headers
        .contains(&("ce-type".to_string(), "com.example.reply".to_string())));
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
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    plugin.answer_call_with(
        &mut ctx,
        1,
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
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    plugin.answer_call_with(
        &mut ctx,
        1,
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
fn a_structured_reply_is_passed_on_whole_at_the_limit() {
    let plugin = FakeEnvoy::configured(REPLYING);
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    let body = [b'x'; 64];
    plugin.answer_call_with(
        &mut ctx,
        1,
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
    plugin.answer_call_with(&mut ctx, 1, 200, &[("ce-type", "t")], &[b'x'; 65]);
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
    plugin.answer_call_with(&mut ctx, 1, 200, &[("ce-type", "t")], b"answer");
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
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    plugin.answer_call_with(&mut ctx, 1, 200, &[("ce-type", "reply")], b"answer");
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
            .map(|(_, v)| v.as_str())
            .collect::<Vec<_>>(),
        ["503"]
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

#[test]
fn a_structured_dead_letter_carries_the_attributes_in_its_json() {
    let plugin = FakeEnvoy::configured(REPLYING);
    let mut headers = post("x");
    headers.push(("content-type", "application/cloudevents+json"));
    let event = br#"{"specversion":"1.0","id":"1","source":"/s","type":"t"}"#;
    let mut ctx = send(&plugin, &headers, event);
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(400), "no");
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    let want = r#"{"specversion":"1.0","id":"1","source":"/s","type":"t","knativeerrordest":"http://plain/","knativeerrorcode":400,"knativeerrordata":"bm8="}"#;
    assert_eq!(String::from_utf8(dlq.body.clone()).unwrap(), want);
    assert!(!dlq.headers.iter().any(|(n, _)| n.starts_with("ce-")));
    assert_eq!(
        header_of(&dlq, "x-fanout-failed-status").as_deref(),
        Some("400")
    );
}

#[test]
fn retry_after_never_shortens_the_backoff_and_is_read_on_429_and_503_only() {
    let config = r#"{"delivery": {"retry": 3, "backoff_policy": "linear",
        "backoff_delay_ms": 500, "backoff_max_ms": 60000},
        "subscribers": [{"cluster": "a"}]}"#;
    for (status, retry_after, wait) in [
        (503, "0", 500),
        (429, "1", 1000),
        (503, "2", 2000),
        (500, "2", 500),
        (504, "2", 500),
        (429, "soon", 500),
    ] {
        let mut plugin = FakeEnvoy::configured(config);
        let mut ctx = send(&plugin, &post("x"), b"event");
        plugin.answer_call_with(&mut ctx, 1, status, &[("retry-after", retry_after)], b"");
        plugin.tick_at(wait - 1);
        assert_eq!(
            plugin.state().dispatched.len(),
            1,
            "{status} retry-after {retry_after}: retried before {wait} ms"
        );
        plugin.tick_at(wait);
        assert_eq!(
            plugin.state().dispatched.len(),
            2,
            "{status} retry-after {retry_after}: not retried at {wait} ms"
        );
    }
}

#[test]
fn retry_after_as_an_http_date_is_read_against_the_hosts_wall_clock() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"delivery": {"retry": 1, "backoff_delay_ms": 1, "backoff_max_ms": 60000},
            "subscribers": [{"cluster": "a"}]}"#,
    );
    // 2015-10-21T07:28:00Z is 1445412480000 ms after the epoch; the host says it is 3 s
    // before.
    let now = 1_445_412_477_000;
    plugin.host.0.borrow_mut().now_ms = now;
    let mut ctx = send(&plugin, &post("x"), b"event");
    plugin.answer_call_with(
        &mut ctx,
        1,
        429,
        &[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")],
        b"",
    );
    plugin.tick_at(now + 2999);
    assert_eq!(plugin.state().dispatched.len(), 1);
    plugin.tick_at(now + 3000);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn async_answers_202_at_once_and_the_root_delivers_after_the_sender_left() {
    let mut plugin = FakeEnvoy::configured(ASYNC);
    let ctx = send(&plugin, &post("x"), b"event");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert!(plugin.state().dispatched.is_empty(), "sent from the stream");
    drop(ctx);
    plugin.host.0.borrow_mut().gone.insert(STREAM);
    plugin.tick_at(1);
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 2);
    assert!(calls
        .iter()
        .all(|c| c.context == ROOT && c.body == b"event"));
    plugin.answer_root_call(calls[0].token, Some(200), "", &[]);
    plugin.answer_root_call(calls[1].token, Some(200), "", &[]);
    assert_eq!(plugin.answers().len(), 1, "nothing more to answer");
    plugin.tick_at(2000);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
}

#[test]
fn async_past_max_in_flight_is_503_not_dropped() {
    let mut plugin = FakeEnvoy::configured(ASYNC);
    let _a = send(&plugin, &post("x"), b"1");
    let _b = send(&plugin, &post("x"), b"2");
    let _c = send(&plugin, &post("x"), b"3");
    let answers = plugin.answers();
    assert_eq!(
        answers.iter().map(|a| a.status).collect::<Vec<_>>(),
        vec![202, 202, 503]
    );
    assert!(answers[2]
        .headers
        .contains(&("retry-after", "1".to_string())));
    // Once one is delivered there is room again.
    plugin.tick_at(1);
    let calls: Vec<Dispatched> = plugin.state().dispatched.clone();
    for call in calls.into_iter().take(2) {
        plugin.answer_root_call(call.token, Some(200), "", &[]);
    }
    let _d = send(&plugin, &post("x"), b"4");
    assert_eq!(plugin.answers().last().unwrap().status, 202);
}

#[test]
fn an_async_failure_after_the_202_is_counted() {
    let mut plugin =
        FakeEnvoy::configured(r#"{"mode": "async", "subscribers": [{"cluster": "a"}]}"#);
    let _ctx = send(&plugin, &post("x"), b"event");
    plugin.tick_at(1);
    plugin.answer_root_call(plugin.last_call().token, Some(500), "", &[]);
    plugin.tick_at(2000);
    assert_eq!(plugin.state().value("fanout.requests.undelivered"), 1);
    assert_eq!(plugin.state().value("fanout.requests.accepted"), 1);
}

#[test]
fn a_root_call_that_never_comes_back_is_given_up_after_its_worst_case() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"mode": "async", "timeout_ms": 1000, "subscribers": [{"cluster": "a"}]}"#,
    );
    let _ctx = send(&plugin, &post("x"), b"event");
    plugin.tick_at(1);
    assert_eq!(plugin.state().dispatched.len(), 1);
    // Envoy drops the call: no answer ever comes.
    plugin.tick_at(1000 + 29_000);
    plugin.tick_at(31_500);
    plugin.tick_at(33_000);
    let state = plugin.state();
    assert_eq!(state.value("fanout.requests.undelivered"), 1);
    assert_eq!(state.value("fanout.in_flight"), 0);
}
