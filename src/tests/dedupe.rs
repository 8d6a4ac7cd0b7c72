//! `dedupe`: redelivery without duplicates, through Envoy's shared data as the fake host
//! keeps it (one store for every worker).

use super::*;

#[test]
fn configure_creates_the_shard_keys() {
    let plugin = FakeEnvoy::configured(DEDUPE);
    let state = plugin.state();
    let shared = state.shared.borrow();
    let mut keys: Vec<&String> = shared.values.keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "fanout.dedupe.slot.0",
            "fanout.dedupe.slot.1",
            "fanout.dedupe.slot.2",
            "fanout.dedupe.slot.3"
        ]
    );
    assert!(shared.values.values().all(|(v, _)| v.is_empty()));
}

#[test]
fn a_redelivery_calls_only_the_subscriber_that_failed() {
    let mut plugin = FakeEnvoy::configured(DEDUPE);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(503), "down");
    plugin.answer_call(&mut ctx, 3, Some(200), "");
    assert_eq!(plugin.last_answer().status, 500);
    assert!(report(&plugin.last_answer())
        .get("already_delivered")
        .is_none());

    // The sender retries: only shipping is called, and the 202 names the others.
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(
        plugin.dispatched_since(3),
        [(4, "shipping".to_string())],
        "only the failed subscriber is called again"
    );
    plugin.answer_call(&mut ctx, 4, Some(200), "");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        FakeEnvoy::header(&answer, "x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    let doc = report(&answer);
    assert_eq!(
        doc["already_delivered"],
        serde_json::json!(["billing", "analytics"])
    );
    assert_eq!(doc["delivered"], 1);

    // Once more: everybody has it, 202 at once, nobody called.
    let _ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 4);
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        FakeEnvoy::header(&answer, "x-fanout-already-delivered").as_deref(),
        Some("3")
    );
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.skipped"), 5);
    assert_eq!(plugin.state().value("fanout.dedupe.entries"), 1);
    assert_eq!(plugin.state().value("fanout.requests.accepted"), 2);
}

#[test]
fn a_request_without_the_key_fans_out_to_everyone_and_is_counted() {
    let mut plugin = FakeEnvoy::configured(DEDUPE);
    for _ in 0..2 {
        let mut ctx = send(&plugin, &post("orders.default"), b"{}");
        let n = plugin.state().dispatched.len();
        for token in n as u32 - 2..=n as u32 {
            plugin.answer_call(&mut ctx, token, Some(200), "");
        }
        assert_eq!(plugin.last_answer(), Answer::accepted());
    }
    assert_eq!(plugin.state().dispatched.len(), 6);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.missing_key"), 2);
    assert_eq!(plugin.state().shared.borrow().events(), 0);
}

#[test]
fn the_same_id_from_two_sources_is_two_events() {
    let mut plugin = FakeEnvoy::configured(&dedupe_by_identity());
    assert_eq!(deliver(&plugin, &from("/orders/eu", "1"), b"{}"), 3);
    assert_eq!(deliver(&plugin, &from("/orders/us", "1"), b"{}"), 3);
    // A copy of either is a duplicate.
    assert_eq!(deliver(&plugin, &from("/orders/eu", "1"), b"{}"), 0);
    assert_eq!(deliver(&plugin, &from("/orders/us", "1"), b"{}"), 0);
    // The id alone is no identity: fanned out to everyone, counted.
    assert_eq!(deliver(&plugin, &event("1"), b"{}"), 3);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.entries"), 2);
    assert_eq!(plugin.state().value("fanout.dedupe.missing_key"), 1);
}

#[test]
fn a_structured_event_is_named_by_the_source_and_id_in_its_body() {
    let mut plugin = FakeEnvoy::configured(&dedupe_by_identity());
    let mut headers = post("orders.default");
    headers.push(("content-type", "application/cloudevents+json"));
    let event = |source: &str| {
        format!(r#"{{"specversion": "1.0", "type": "t", "source": "{source}", "id": "1"}}"#)
    };
    assert_eq!(deliver(&plugin, &headers, event("/a").as_bytes()), 3);
    assert_eq!(deliver(&plugin, &headers, event("/b").as_bytes()), 3);
    assert_eq!(deliver(&plugin, &headers, event("/a").as_bytes()), 0);
    // Its binary copy is the same event.
    assert_eq!(deliver(&plugin, &from("/b", "1"), b"{}"), 0);
    // A body that does not parse has no identity; without filters it is no 400 either.
    assert_eq!(deliver(&plugin, &headers, b"{not json"), 3);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.missing_key"), 1);
}

#[test]
fn continue_mode_reads_a_structured_identity_at_end_of_stream() {
    let config = dedupe_by_identity().replacen('{', r#"{"body_wait": "continue", "#, 1);
    let plugin = FakeEnvoy::configured(&config);
    let mut headers = post("orders.default");
    headers.push(("content-type", "application/cloudevents+json"));
    let body = br#"{"specversion": "1.0", "type": "t", "source": "/a", "id": "1"}"#;
    for expected in [3, 0] {
        let before = plugin.state().dispatched.len();
        let mut ctx = plugin.stream(&headers, body);
        assert_eq!(ctx.on_request_headers(false), Flow::Continue);
        assert_eq!(ctx.on_request_body(body.len(), true), Flow::Pause);
        let calls = plugin.dispatched_since(before);
        assert_eq!(calls.len(), expected);
        for (token, _) in &calls {
            plugin.answer_call(&mut ctx, *token, Some(200), "");
        }
        assert_eq!(plugin.last_answer().status, 202);
    }
}

// Two workers, the same event at once: the second calls nobody and says "in progress" (409),
// and after the first has delivered, a retry gets 202 without any call.
#[test]
fn the_same_event_on_two_workers_is_delivered_once() {
    let first = FakeEnvoy::configured(DEDUPE);
    let second = first.another_worker(DEDUPE);
    let mut a = send(&first, &event("e1"), b"{}");
    assert_eq!(first.state().dispatched.len(), 3);
    let _b = send(&second, &event("e1"), b"{}");
    assert!(second.state().dispatched.is_empty(), "called twice");
    let answer = second.only_answer();
    assert_eq!(answer.status, 409);
    assert_eq!(
        FakeEnvoy::header(&answer, "retry-after").as_deref(),
        Some("1")
    );
    assert_eq!(
        report(&answer)["in_progress"],
        serde_json::json!(["billing", "shipping", "analytics"])
    );
    for token in 1..=3 {
        first.answer_call(&mut a, token, Some(200), "");
    }
    assert_eq!(first.only_answer(), Answer::accepted());
    let _c = send(&second, &event("e1"), b"{}");
    assert!(second.state().dispatched.is_empty());
    assert_eq!(second.last_answer().status, 202);
}

// A client that goes away: what was delivered is recorded, the rest is released.
#[test]
fn a_client_that_goes_away_releases_its_claims() {
    let plugin = FakeEnvoy::configured(DEDUPE);
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    assert!(ctx.on_done());
    let _retry = send(&plugin, &event("e1"), b"{}");
    assert_eq!(
        plugin.dispatched_since(3),
        [(4, "shipping".to_string()), (5, "analytics".to_string())]
    );
}

#[test]
fn records_expire_after_ttl() {
    let plugin = FakeEnvoy::configured(DEDUPE);
    plugin.host.0.borrow_mut().now_ms = 10_000;
    let mut ctx = send(&plugin, &event("e1"), b"{}");
    for token in 1..=3 {
        plugin.answer_call(&mut ctx, token, Some(200), "");
    }
    plugin.host.0.borrow_mut().now_ms = 10_999;
    let _ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 3, "still remembered");
    plugin.host.0.borrow_mut().now_ms = 11_000;
    let _ctx = send(&plugin, &event("e1"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), 6, "forgotten after ttl_ms");
}

#[test]
fn the_store_never_holds_more_than_max_entries() {
    let mut plugin = FakeEnvoy::configured(DEDUPE);
    for i in 0..1000 {
        let id = format!("e{i}");
        let mut ctx = send(&plugin, &event(&id), b"{}");
        let n = plugin.state().dispatched.len() as u32;
        for token in n - 2..=n {
            plugin.answer_call(&mut ctx, token, Some(200), "");
        }
        assert!(plugin.state().shared.borrow().events() <= 100);
    }
    assert_eq!(plugin.state().shared.borrow().events(), 100);
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.dedupe.entries"), 100);
    // The oldest were evicted: e0 goes to everyone again; the newest is still known.
    let before = plugin.state().dispatched.len();
    let _old = send(&plugin, &event("e0"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), before + 3);
    let _new = send(&plugin, &event("e999"), b"{}");
    assert_eq!(plugin.state().dispatched.len(), before + 3);
}

// The per-request cost: host calls on the shared data, dedupe off and on.
#[test]
fn dedupe_costs_four_shared_data_calls_per_request() {
    let calls = |plugin: &FakeEnvoy| {
        let state = plugin.state();
        let shared = state.shared.borrow();
        shared.gets + shared.sets
    };
    let off = FakeEnvoy::configured(THREE);
    let mut ctx = send(&off, &event("e1"), b"{}");
    for token in 1..=3 {
        off.answer_call(&mut ctx, token, Some(200), "");
    }
    assert_eq!(calls(&off), 0);

    let on = FakeEnvoy::configured(DEDUPE);
    let after_configure = calls(&on);
    let mut ctx = send(&on, &event("e1"), b"{}");
    assert_eq!(calls(&on) - after_configure, 2, "claim: get + set");
    for token in 1..=3 {
        on.answer_call(&mut ctx, token, Some(200), "");
    }
    assert_eq!(calls(&on) - after_configure, 4, "settle: get + set");
    let _again = send(&on, &event("e1"), b"{}");
    assert_eq!(calls(&on) - after_configure, 5, "all delivered: one get");
    let _no_key = send(&on, &post("orders.default"), b"{}");
    assert_eq!(calls(&on) - after_configure, 5, "no key: nothing");
}

#[test]
fn a_subscriber_its_filter_skipped_is_never_claimed_nor_recorded() {
    let config = FILTERED.replacen('{', r#"{"dedupe": {}, "#, 1);
    let plugin = FakeEnvoy::configured(&config);
    let created = with(
        "orders.default",
        &[
            ("ce-specversion", "1.0"),
            ("ce-id", "e1"),
            ("ce-source", "/s"),
            ("ce-type", "order.created"),
        ],
    );
    let mut ctx = send(&plugin, &created, b"{}");
    assert_eq!(clusters(&plugin), ["created", "everything"]);
    assert_eq!(
        shard_marks(&plugin),
        2,
        "only the called subscribers are claimed"
    );
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    assert_eq!(shard_marks(&plugin), 2);

    // The same id, another type: "shipped" wants it now; it was never recorded, so it is
    // called; "everything" already has it; "created" is skipped by its filter.
    let mut shipped = created.clone();
    shipped.retain(|(n, _)| *n != "ce-type");
    shipped.push(("ce-type", "order.shipped"));
    let mut ctx = send(&plugin, &shipped, b"{}");
    assert_eq!(clusters(&plugin), ["created", "everything", "shipped"]);
    plugin.answer_call(&mut ctx, 3, Some(200), "");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    let doc = report(&answer);
    assert_eq!(doc["skipped"], serde_json::json!(["created"]));
    assert_eq!(doc["already_delivered"], serde_json::json!(["everything"]));
    assert_eq!(doc["delivered"], 1);
}

#[test]
fn a_dead_lettered_subscriber_counts_as_delivered() {
    let config = WITH_DEAD_LETTER.replacen('{', r#"{"dedupe": {}, "#, 1);
    let plugin = FakeEnvoy::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "7"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(&mut ctx, 1, Some(400), "no");
    assert_eq!(plugin.last_call().cluster, "dlq");
    plugin.answer_call(&mut ctx, 2, Some(200), "");
    assert_eq!(plugin.only_answer().status, 202);
    let _again = send(&plugin, &headers, b"event");
    assert_eq!(plugin.state().dispatched.len(), 2, "called again");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        report(&answer)["already_delivered"],
        serde_json::json!(["a"])
    );
}

#[test]
fn a_retry_from_the_root_is_recorded_when_the_root_ends_the_fan_out() {
    let config = RETRY_TWICE.replacen('{', r#"{"dedupe": {}, "#, 1);
    let mut plugin = FakeEnvoy::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "r1"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(503), "busy");
    plugin.tick_at(200);
    let retry = plugin.last_call();
    assert_eq!((retry.cluster.as_str(), retry.context), ("b", ROOT));
    plugin.answer_root_call(retry.token, Some(200), "", &[]);
    assert_eq!(plugin.only_answer(), Answer::accepted());
    let _again = send(&plugin, &headers, b"event");
    assert_eq!(plugin.state().dispatched.len(), 3, "called again");
    assert_eq!(
        FakeEnvoy::header(&plugin.last_answer(), "x-fanout-already-delivered").as_deref(),
        Some("2")
    );
}

#[test]
fn a_fan_out_the_root_ends_on_its_tick_is_answered_and_recorded() {
    // b's retry (sent by the root) never comes back: the root's tick gives it up and ends the
    // fan-out there. The sender still gets its answer, and a is recorded.
    let config = RETRY_TWICE.replacen('{', r#"{"dedupe": {"ttl_ms": 86400000}, "#, 1);
    let mut plugin = FakeEnvoy::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "lost"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(503), "busy");
    plugin.tick_at(200);
    assert_eq!(plugin.last_call().context, ROOT, "b's retry, from the root");
    plugin.tick_at(10_000_000);
    assert_eq!(plugin.only_answer().status, 500);
    // The sender's retry: a was recorded by the settle the tick made, so only b is called.
    let _again = send(&plugin, &headers, b"event");
    assert_eq!(plugin.dispatched_since(3), [(4, "b".to_string())]);
}

#[test]
fn a_sync_sender_that_leaves_during_a_retry_wait_releases_the_claim() {
    let config = RETRY_TWICE.replacen('{', r#"{"dedupe": {}, "#, 1);
    let mut plugin = FakeEnvoy::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "r1"));
    let mut ctx = send(&plugin, &headers, b"event");
    plugin.answer_call(&mut ctx, 1, Some(200), "");
    plugin.answer_call(&mut ctx, 2, Some(503), "");
    assert!(ctx.on_done());
    plugin.host.0.borrow_mut().gone.insert(STREAM);
    plugin.tick_at(10_000);
    // The sender's retry: a is recorded, b's claim was released, so b is called (not 409).
    plugin.host.0.borrow_mut().gone.clear();
    let _retry = send(&plugin, &headers, b"event");
    assert_eq!(plugin.dispatched_since(2), [(3, "b".to_string())]);
}

#[test]
fn async_records_at_the_end_of_the_background_delivery() {
    let config = ASYNC.replacen('{', r#"{"dedupe": {}, "#, 1);
    let mut plugin = FakeEnvoy::configured(&config);
    let mut headers = post("x");
    headers.push(("ce-source", "/s"));
    headers.push(("ce-id", "a1"));
    let _first = send(&plugin, &headers, b"event");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // A redelivery while the first is still being delivered: nobody called, 409.
    let _second = send(&plugin, &headers, b"event");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 409);
    assert_eq!(
        FakeEnvoy::header(&answer, "retry-after").as_deref(),
        Some("1")
    );
    plugin.tick_at(1);
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 2, "the 409 request called somebody");
    plugin.answer_root_call(calls[0].token, Some(200), "", &[]);
    plugin.answer_root_call(calls[1].token, Some(200), "", &[]);
    // Recorded: a third copy is answered 202 at once and calls nobody, not even later.
    let _third = send(&plugin, &headers, b"event");
    let answer = plugin.last_answer();
    assert_eq!(answer.status, 202);
    assert_eq!(
        FakeEnvoy::header(&answer, "x-fanout-already-delivered").as_deref(),
        Some("2")
    );
    plugin.tick_at(2);
    assert_eq!(plugin.state().dispatched.len(), 2);
    plugin.tick_at(2000);
    assert_eq!(plugin.state().value("fanout.dedupe.skipped"), 2);
    assert_eq!(plugin.state().value("fanout.dedupe.in_progress"), 2);
    assert_eq!(plugin.state().value("fanout.requests.undelivered"), 0);
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
}

#[test]
fn async_past_max_in_flight_claims_nothing() {
    let config = ASYNC.replacen('{', r#"{"dedupe": {}, "#, 1);
    let plugin = FakeEnvoy::configured(&config);
    for id in ["1", "2", "3"] {
        let mut headers = post("x");
        headers.push(("ce-source", "/s"));
        headers.push(("ce-id", id));
        let _ctx = send(&plugin, &headers, b"event");
    }
    assert_eq!(plugin.last_answer().status, 503);
    assert_eq!(shard_marks(&plugin), 4, "the refused event left claims");
}
