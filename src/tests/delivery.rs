//! Delivery: one call per subscriber and the 202 or 500 when they end, late and unknown
//! callbacks, async mode, calls that never come back.

use super::*;

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
        calls[0].text_headers(),
        expect("/events", "billing.local", &[("x-tenant", "acme")])
    );
    assert_eq!(calls[1].text_headers(), expect("/", "shipping", &[]));
    assert_eq!(calls[2].text_headers(), expect("/in", "analytics", &[]));
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
    plugin.answer(&mut ctx, "shipping", Some(200), "");
    plugin.answer(&mut ctx, "billing", Some(204), "");
    assert!(plugin.answers().is_empty());
    plugin.answer(&mut ctx, "analytics", Some(202), "ignored body");
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
    plugin.answer(&mut ctx, "billing", Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 35;
    plugin.answer(&mut ctx, "shipping", Some(500), "database down\r\n");
    plugin.answer(&mut ctx, "analytics", Some(200), "");
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
        plugin.answer(&mut ctx, "a", *status, body);
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
    plugin.answer(&mut ctx, "billing", Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer(&mut ctx, "analytics", Some(200), "");
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
    plugin.answer_call(&mut ctx, NEVER_SENT, Some(500), "stranger");
    plugin.answer(&mut ctx, "billing", Some(200), "");
    plugin.answer(&mut ctx, "billing", Some(500), "duplicate");
    plugin.answer(&mut ctx, "shipping", Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer(&mut ctx, "analytics", Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    plugin.answer(&mut ctx, "analytics", Some(500), "late");
    plugin.answer(&mut ctx, "shipping", None, "");
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
    plugin.answer(&mut second, "a", Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
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

/// Envoy's answer to a call its circuit breaker refused once the call had a connection.
const OVERFLOW_BODY: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: overflow";

// Envoy 1.40 refuses a call past a full circuit breaker in two forms: a callback 503 with
// "reset reason: overflow", or `dispatch_http_call` failing inline. Both are `overflow`.
#[test]
fn a_circuit_breaker_overflow_in_either_form_is_reported_and_counted_as_overflow() {
    let mut plugin =
        FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#);
    plugin
        .host
        .0
        .borrow_mut()
        .overflowing_clusters
        .insert("b".into());
    let mut ctx = send(&plugin, &post("x"), b"e");
    assert_eq!(clusters(&plugin), ["a"], "a refused call was sent");
    plugin.answer(&mut ctx, "a", Some(503), OVERFLOW_BODY);
    let doc = report(&plugin.only_answer());
    for (failed, cluster) in doc["failed"].as_array().unwrap().iter().zip(["a", "b"]) {
        assert_eq!(failed["cluster"], cluster);
        assert_eq!(failed["outcome"], "overflow", "{failed}");
        let detail = failed["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("circuit breaker of cluster \"{cluster}\" is full")),
            "{detail}"
        );
    }
    assert_eq!(plugin.flushed("fanout.subscriber.a.failed.overflow"), 1);
    assert_eq!(
        plugin.state().value("fanout.subscriber.b.failed.overflow"),
        1
    );
    assert_eq!(plugin.state().value("fanout.subscriber.a.failed.reset"), 0);
}

#[test]
fn an_overflow_is_retried_and_dead_lettered_as_overflow() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"delivery": {"retry": 1, "backoff_delay_ms": 100,
             "dead_letter": {"cluster": "dlq"}}, "subscribers": [{"cluster": "a"}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"e");
    plugin.answer(&mut ctx, "a", Some(503), OVERFLOW_BODY);
    plugin
        .host
        .0
        .borrow_mut()
        .overflowing_clusters
        .insert("a".into());
    // The retry is refused at dispatch: the dead letter goes out, naming the outcome.
    plugin.tick_at(10_000);
    let letter = plugin.last_call();
    assert_eq!(letter.cluster, "dlq");
    assert_eq!(
        header_of(&letter, "x-fanout-failed-outcome").as_deref(),
        Some("overflow")
    );
    assert_eq!(
        header_of(&letter, "x-fanout-failed-attempts").as_deref(),
        Some("2")
    );
    plugin.answer_root_call(letter.token, Some(200), "", &[]);
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
}

/// The core's own work per request, for callgrind (steadier than Envoy's count; natively, or
/// in wasm32 by `bench/wasm_probe.py`): `FANOUT_PROBE_N` sync fan-outs (default 2,000) to
/// `FANOUT_PROBE_SUBSCRIBERS` subscribers (default four), each call answered 200. Run twice,
/// at N and 3N, and take the difference over 2N: the setup cancels out. See bench/README.md.
#[test]
#[ignore]
fn callgrind_probe_sync_fan_outs_to_four() {
    let from_env = |name: &str, default: usize| -> usize {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let n = from_env("FANOUT_PROBE_N", 2000);
    let subscribers: Vec<String> = (0..from_env("FANOUT_PROBE_SUBSCRIBERS", 4))
        .map(|i| format!(r#"{{"cluster": "s{i}"}}"#))
        .collect();
    let plugin = FakeEnvoy::configured(&format!(
        r#"{{"subscribers": [{}]}}"#,
        subscribers.join(", ")
    ));
    for _ in 0..n {
        let before = plugin.state().dispatched.len();
        let mut ctx = send(&plugin, &post("x"), b"{}");
        for (token, _) in plugin.dispatched_since(before) {
            plugin.answer_call(&mut ctx, token, Some(200), "");
        }
        ctx.on_done();
    }
    let answers = plugin.answers();
    assert_eq!(answers.len(), n);
    assert!(answers.iter().all(|a| a.status == 202));
}
