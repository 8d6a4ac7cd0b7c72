//! `max_concurrent_calls` and `max_queued_calls`: calls beyond the cap wait in line and are
//! sent by the root context as calls end; a new event that would queue beyond the limit is
//! refused with nobody called.

use super::*;

/// Two streams at once (distinct context ids).
fn open_stream(plugin: &FakeEnvoy, id: u32, body: &[u8]) -> Stream<FakeHost> {
    let mut state = plugin.host.0.borrow_mut();
    state.request_headers = post("x")
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    state.request_body = body.to_vec();
    state.effective = id;
    drop(state);
    let mut ctx = plugin.root.create_stream(id);
    assert_eq!(ctx.on_request_headers(false), Flow::Pause);
    assert_eq!(ctx.on_request_body(body.len(), true), Flow::Pause);
    ctx
}

#[test]
fn a_call_beyond_the_cap_waits_and_is_sent_from_the_root_when_a_call_ends() {
    let mut plugin =
        FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a", "max_concurrent_calls": 1}]}"#);
    let mut first = open_stream(&plugin, 10, b"one");
    let _second = open_stream(&plugin, 11, b"two");
    assert_eq!(clusters(&plugin), ["a"], "the cap let a second call out");
    // The gauges, as flushed on the root's tick.
    plugin.tick_at(1000);
    assert_eq!(
        plugin.state().value("fanout.subscriber.a.calls_in_flight"),
        1
    );
    assert_eq!(plugin.state().value("fanout.subscriber.a.calls_queued"), 1);
    let token = plugin.last_call().token;
    plugin.host.0.borrow_mut().effective = 10;
    plugin.answer_call(&mut first, token, Some(200), "");
    assert_eq!(plugin.answers().len(), 1);
    // Its slot goes to the waiting call, sent by the root's next tick.
    assert_eq!(plugin.state().dispatched.len(), 1);
    plugin.tick_at(1010);
    let second = plugin.last_call();
    assert_eq!(
        (second.body.as_slice(), second.context),
        (&b"two"[..], ROOT)
    );
    plugin.answer_root_call(second.token, Some(200), "", &[]);
    assert_eq!(plugin.answers().len(), 2);
    assert!(plugin.answers().iter().all(|a| a.status == 202));
    plugin.tick_at(3000);
    assert_eq!(
        plugin.state().value("fanout.subscriber.a.calls_in_flight"),
        0
    );
    assert_eq!(plugin.state().value("fanout.subscriber.a.calls_queued"), 0);
}

#[test]
fn a_full_line_refuses_the_event_naming_the_subscriber_and_nobody_is_called() {
    for mode in ["sync", "async"] {
        let mut plugin = FakeEnvoy::configured(&format!(
            r#"{{"mode": "{mode}", "subscribers": [{{"cluster": "b"}},
                {{"cluster": "a", "max_concurrent_calls": 1, "max_queued_calls": 0}}]}}"#
        ));
        let _first = open_stream(&plugin, 10, b"one");
        plugin.tick_at(10);
        let calls = plugin.state().dispatched.len();
        assert_eq!(calls, 2, "{mode}");
        let _second = open_stream(&plugin, 11, b"two");
        plugin.tick_at(20);
        assert_eq!(
            plugin.state().dispatched.len(),
            calls,
            "{mode}: somebody was called"
        );
        let answer = plugin.last_answer();
        assert_eq!(answer.status, 503, "{mode}");
        assert_eq!(
            FakeEnvoy::header(&answer, "retry-after").as_deref(),
            Some("1")
        );
        let error = report(&answer);
        assert_eq!(error["subscriber"], "a", "{mode}: {error}");
        assert!(error["error"]
            .as_str()
            .unwrap()
            .contains("max_queued_calls 0"));
        assert_eq!(plugin.flushed("fanout.subscriber.a.refused"), 1, "{mode}");
    }
}

#[test]
fn a_retry_waits_in_line_but_is_never_refused() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"delivery": {"retry": 1, "backoff_delay_ms": 10},
            "subscribers": [{"cluster": "a", "max_concurrent_calls": 1, "max_queued_calls": 1}]}"#,
    );
    let mut first = open_stream(&plugin, 10, b"one");
    let _second = open_stream(&plugin, 11, b"two");
    let token = plugin.last_call().token;
    plugin.host.0.borrow_mut().effective = 10;
    // The first fails: its slot goes to the second; its retry waits in line beyond
    // max_queued_calls, and is not refused.
    plugin.answer_call(&mut first, token, Some(503), "");
    plugin.tick_at(5);
    let second = plugin.last_call();
    assert_eq!(second.body, b"two");
    plugin.tick_at(100);
    assert_eq!(plugin.state().dispatched.len(), 2, "the retry did not wait");
    plugin.answer_root_call(second.token, Some(200), "", &[]);
    plugin.tick_at(110);
    let retry = plugin.last_call();
    assert_eq!(retry.body, b"one");
    plugin.answer_root_call(retry.token, Some(200), "", &[]);
    assert_eq!(plugin.answers().len(), 2);
    assert!(plugin.answers().iter().all(|a| a.status == 202));
}

#[test]
fn a_sender_leaving_takes_its_waiting_calls_out_of_line_and_frees_its_slots() {
    let mut plugin =
        FakeEnvoy::configured(r#"{"subscribers": [{"cluster": "a", "max_concurrent_calls": 1}]}"#);
    let mut first = open_stream(&plugin, 10, b"one");
    let mut second = open_stream(&plugin, 11, b"two");
    assert!(second.on_done(), "the waiting one leaves");
    assert!(
        first.on_done(),
        "the one in flight leaves (Envoy cancels its call)"
    );
    let _third = open_stream(&plugin, 12, b"three");
    plugin.tick_at(10);
    let calls: Vec<Vec<u8>> = plugin
        .state()
        .dispatched
        .iter()
        .map(|d| d.body.clone())
        .collect();
    assert_eq!(calls, [b"one".to_vec(), b"three".to_vec()]);
}
