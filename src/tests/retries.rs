//! Retries and dead letters: the backoff and `Retry-After`, retries sent from the root
//! context, what a dead letter carries.

use super::*;

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
    plugin.answer(&mut ctx, "a", Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 5;
    plugin.answer(&mut ctx, "b", Some(503), "busy");
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
    plugin.answer(&mut ctx, "a", Some(200), "");
    plugin.answer(&mut ctx, "b", Some(503), "");
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
    plugin.answer(&mut ctx, "a", Some(200), "");
    plugin.answer(&mut ctx, "b", Some(500), "");
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
    plugin.answer(&mut ctx, "a", Some(200), "");
    plugin.answer(&mut ctx, "b", Some(400), "bad event");
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
    ctx.on_call_response(plugin.host.token_of("a"), 2, 0);
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
    plugin.answer(&mut ctx, "a", Some(500), "db\ndown");
    // The dead letter goes out at once, from the stream.
    let dlq = plugin.last_call();
    assert_eq!(dlq.cluster, "dlq");
    assert_eq!(dlq.body, b"event");
    let header = |name: &str| {
        dlq.header(name)
            .map(|v| String::from_utf8(v.to_vec()).unwrap())
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
    plugin.answer(&mut ctx, "a", Some(500), "");
    plugin.answer(&mut ctx, "dlq", Some(503), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert_eq!(report(&answer)["failed"][0]["leg"], "dead_letter");
}

#[test]
fn a_structured_dead_letter_carries_the_attributes_in_its_json() {
    let plugin = FakeEnvoy::configured(REPLYING);
    let mut headers = post("x");
    headers.push(("content-type", "application/cloudevents+json"));
    let event = br#"{"specversion":"1.0","id":"1","source":"/s","type":"t"}"#;
    let mut ctx = send(&plugin, &headers, event);
    plugin.answer(&mut ctx, "answering", Some(200), "");
    plugin.answer(&mut ctx, "plain", Some(400), "no");
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
        plugin.answer_with(&mut ctx, "a", status, &[("retry-after", retry_after)], b"");
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
    plugin.answer_with(
        &mut ctx,
        "a",
        429,
        &[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")],
        b"",
    );
    plugin.tick_at(now + 2999);
    assert_eq!(plugin.state().dispatched.len(), 1);
    plugin.tick_at(now + 3000);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

/// The wait before the retry of one request's only call, which fails at `t0` with `status`
/// and `headers`: found by ticking every 5 ms (the retry then succeeds).
fn retry_wait(plugin: &mut FakeEnvoy, t0: u64, status: u16, headers: &[(&str, &str)]) -> u64 {
    plugin.host.0.borrow_mut().now_ms = t0;
    let mut ctx = send(plugin, &post("x"), b"event");
    let sent = plugin.state().dispatched.len();
    plugin.answer_call_with(&mut ctx, plugin.last_call().token, status, headers, b"");
    let mut t = t0;
    while plugin.state().dispatched.len() == sent {
        t += 5;
        assert!(t < t0 + 100_000, "never retried");
        plugin.tick_at(t);
    }
    plugin.answer_root_call(plugin.last_call().token, Some(200), "", &[]);
    t - t0
}

const JITTERED: &str = r#"{"delivery": {"retry": 1, "backoff_policy": "linear",
    "backoff_delay_ms": 1000, "backoff_max_ms": 60000, "backoff_jitter": 0.5},
    "subscribers": [{"cluster": "a"}]}"#;

#[test]
fn jitter_spreads_each_fan_outs_retry_wait_over_its_factor() {
    let mut plugin = FakeEnvoy::configured(JITTERED);
    let waits: Vec<u64> = (0..40)
        .map(|i| retry_wait(&mut plugin, 10_000 * (i + 1), 503, &[]))
        .collect();
    // 1000 ms spread over [500, 1500], seen to the next 5 ms tick.
    assert!(waits.iter().all(|w| (500..=1505).contains(w)), "{waits:?}");
    let low = waits.iter().filter(|w| **w < 900).count();
    let high = waits.iter().filter(|w| **w > 1100).count();
    assert!(low >= 5 && high >= 5, "not spread: {waits:?}");
    let mut distinct = waits.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(distinct.len() >= 20, "{waits:?}");
}

#[test]
fn without_jitter_every_retry_waits_the_computed_backoff() {
    let mut plugin = FakeEnvoy::configured(&JITTERED.replace("0.5", "0"));
    for i in 0..5 {
        assert_eq!(retry_wait(&mut plugin, 10_000 * (i + 1), 503, &[]), 1000);
    }
}

#[test]
fn a_jittered_wait_is_never_shorter_than_retry_after_asked() {
    let mut plugin = FakeEnvoy::configured(JITTERED);
    for i in 0..20 {
        let wait = retry_wait(&mut plugin, 10_000 * (i + 1), 429, &[("retry-after", "2")]);
        // The jitter draws at most 1500 ms: Retry-After's 2 s wins every time.
        assert!((2000..=2005).contains(&wait), "{wait}");
    }
}

#[test]
fn workers_configured_at_different_times_draw_different_waits() {
    let mut waits = Vec::new();
    for configured_at in [1, 2] {
        let host = FakeHost::default();
        host.0.borrow_mut().config = Some(JITTERED.as_bytes().to_vec());
        host.0.borrow_mut().now_ms = configured_at;
        let mut root = Plugin::new(ROOT, host.clone());
        assert!(root.on_configure());
        let mut plugin = FakeEnvoy { host, root };
        waits.push(
            (0..8)
                .map(|i| retry_wait(&mut plugin, 10_000 * (i + 1), 503, &[]))
                .collect::<Vec<_>>(),
        );
    }
    assert_ne!(waits[0], waits[1]);
}
