//! Best-effort subscribers (`"required": false`): the answer waits only for the required
//! ones; the rest are called from the root context and go on after it.

use super::*;

const ONE_BEST_EFFORT: &str = r#"{"delivery": {"retry": 1, "backoff_delay_ms": 100,
    "dead_letter": {"cluster": "dlq"}},
    "subscribers": [{"cluster": "a"}, {"cluster": "b", "required": false}]}"#;

fn header(answer: &Answer, name: &str) -> Option<String> {
    FakeEnvoy::header(answer, name)
}

#[test]
fn the_answer_is_sent_when_the_required_ones_end_and_says_how_many_are_pending() {
    let mut plugin = FakeEnvoy::configured(ONE_BEST_EFFORT);
    let mut ctx = send(&plugin, &post("x"), b"e");
    // Only the required subscriber is called from the stream.
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0].cluster.as_str(), calls[0].context), ("a", STREAM));
    // The best-effort one goes out on the root's timer.
    plugin.tick_at(10);
    let b = plugin.last_call();
    assert_eq!((b.cluster.as_str(), b.context), ("b", ROOT));
    plugin.answer_call(&mut ctx, calls[0].token, Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(header(&answer, "x-fanout-pending").as_deref(), Some("1"));
    // The stream ends; its best-effort delivery goes on from the root.
    assert!(ctx.on_done());
    assert_eq!(ctx.on_response_headers(), Flow::Continue);
    plugin.answer_root_call(b.token, Some(200), "", &[]);
    assert_eq!(plugin.answers().len(), 1, "answered twice");
    assert_eq!(plugin.flushed("fanout.subscriber.b.delivered"), 1);
    assert_eq!(plugin.state().value("fanout.requests.accepted"), 1);
    assert_eq!(plugin.state().value("fanout.requests.undelivered"), 0);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
}

#[test]
fn a_failing_best_effort_subscriber_never_makes_a_500_and_is_retried_then_dead_lettered() {
    let mut plugin = FakeEnvoy::configured(ONE_BEST_EFFORT);
    let mut ctx = send(&plugin, &post("x"), b"e");
    plugin.tick_at(10);
    let b = plugin.last_call();
    // It fails before the required one ends: the answer is still 202.
    plugin.answer_root_call(b.token, Some(500), "down", &[]);
    plugin.answer(&mut ctx, "a", Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(header(&answer, "x-fanout-pending").as_deref(), Some("1"));
    assert!(ctx.on_done());
    // Retried, then dead-lettered, from the root.
    plugin.tick_at(1000);
    let retry = plugin.last_call();
    assert_eq!((retry.cluster.as_str(), retry.context), ("b", ROOT));
    plugin.answer_root_call(retry.token, Some(500), "still down", &[]);
    let letter = plugin.last_call();
    assert_eq!((letter.cluster.as_str(), letter.context), ("dlq", ROOT));
    assert_eq!(
        header_of(&letter, "x-fanout-failed-cluster").as_deref(),
        Some("b")
    );
    plugin.answer_root_call(letter.token, Some(200), "", &[]);
    assert_eq!(plugin.flushed("fanout.subscriber.b.dead_lettered"), 1);
    assert_eq!(plugin.answers().len(), 1);
}

#[test]
fn a_best_effort_failure_for_good_is_counted_undelivered_and_a_500_lists_it_apart() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b", "required": false},
            {"cluster": "c", "required": false}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"e");
    plugin.tick_at(10);
    let sent = plugin.state().dispatched.clone();
    let token_of = |cluster: &str| sent.iter().find(|d| d.cluster == cluster).unwrap().token;
    plugin.answer_root_call(token_of("b"), Some(503), "busy", &[]);
    plugin.answer_call(&mut ctx, token_of("a"), Some(500), "broken");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert_eq!(header(&answer, "x-fanout-failed").as_deref(), Some("1"));
    assert_eq!(header(&answer, "x-fanout-pending").as_deref(), Some("1"));
    let doc = report(&answer);
    assert_eq!(doc["failed"].as_array().unwrap().len(), 1);
    assert_eq!(doc["failed"][0]["cluster"], "a");
    assert_eq!(doc["best_effort_failed"][0]["cluster"], "b");
    assert_eq!(doc["best_effort_failed"][0]["status"], 503);
    assert_eq!(doc["best_effort_pending"], serde_json::json!(["c"]));
    plugin.answer_root_call(token_of("c"), Some(200), "", &[]);
    assert_eq!(plugin.flushed("fanout.requests.failed"), 1);
    assert_eq!(plugin.state().value("fanout.requests.undelivered"), 1);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
}

#[test]
fn a_channel_of_best_effort_subscribers_answers_at_once_bounded_by_max_in_flight() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"max_in_flight": 1, "subscribers": [{"cluster": "b", "required": false}]}"#,
    );
    let _first = send(&plugin, &post("x"), b"e");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(header(&answer, "x-fanout-pending").as_deref(), Some("1"));
    assert!(
        plugin.state().dispatched.is_empty(),
        "called from the stream"
    );
    let _second = send(&plugin, &post("x"), b"e");
    assert_eq!(plugin.last_answer().status, 503);
    plugin.tick_at(10);
    let b = plugin.last_call();
    assert_eq!((b.cluster.as_str(), b.context), ("b", ROOT));
    assert_eq!(plugin.state().dispatched.len(), 1);
}

#[test]
fn the_sender_leaving_before_the_answer_drops_the_best_effort_deliveries_too() {
    let mut plugin = FakeEnvoy::configured(ONE_BEST_EFFORT);
    let mut ctx = send(&plugin, &post("x"), b"e");
    assert!(ctx.on_done());
    plugin.tick_at(10);
    assert_eq!(clusters(&plugin), ["a"], "delivered for a sender that left");
}

#[test]
fn with_dedupe_a_best_effort_subscriber_is_recorded_once_it_took_the_event() {
    let mut plugin = FakeEnvoy::configured(&DEDUPE.replace(
        r#"{"cluster": "analytics"}"#,
        r#"{"cluster": "analytics", "required": false}"#,
    ));
    let mut ctx = send(&plugin, &event("1"), b"e");
    for token in [1, 2] {
        plugin.answer_call(&mut ctx, token, Some(200), "");
    }
    assert_eq!(plugin.last_answer().status, 202);
    plugin.tick_at(10);
    let analytics = plugin.last_call();
    assert_eq!(analytics.cluster, "analytics");
    plugin.answer_root_call(analytics.token, Some(200), "", &[]);
    // The redelivery calls nobody: all three are recorded.
    let before = plugin.state().dispatched.len();
    let _again = send(&plugin, &event("1"), b"e");
    plugin.tick_at(20);
    assert_eq!(plugin.state().dispatched.len(), before);
    assert_eq!(plugin.last_answer().status, 202);
    assert_eq!(
        header(&plugin.last_answer(), "x-fanout-already-delivered").as_deref(),
        Some("3")
    );
}
