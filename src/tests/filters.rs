//! Subscription filters: who gets an event, binary or structured, and what a request the
//! filters cannot read gets.

use super::*;

#[test]
fn binary_event_reaches_only_the_subscribers_whose_filter_matches() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with(
        "orders.default",
        &[("ce-type", "order.shipped"), ("ce-id", "1")],
    );
    let mut ctx = send(&plugin, &headers, b"{}");
    assert_eq!(clusters(&plugin), ["shipped", "everything"]);
    // ce-* are not in forward_headers here: filtering does not need them forwarded.
    assert!(plugin.state().dispatched[0]
        .headers
        .iter()
        .all(|(n, _)| !n.starts_with("ce-")));
    plugin.answer(&mut ctx, "shipped", Some(200), "");
    assert!(plugin.answers().is_empty());
    plugin.answer(&mut ctx, "everything", Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn percent_encoded_binary_attributes_are_decoded_before_matching() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with("orders.default", &[("ce-type", "order%2Ecreated")]);
    let _ctx = send(&plugin, &headers, b"");
    assert_eq!(clusters(&plugin), ["created", "everything"]);
}

#[test]
fn structured_event_is_parsed_once_and_filtered() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let body = br#"{"specversion": "1.0", "type": "order.created", "source": "/eu/shop",
                    "id": "7", "data": {"type": "order.shipped", "items": [1, 2]}}"#;
    let headers = with("picky.default", &[STRUCTURED]);
    let mut ctx = send(&plugin, &headers, body);
    assert_eq!(clusters(&plugin), ["created", "eu"]);
    assert_eq!(plugin.state().body_reads, 1);
    assert_eq!(plugin.state().dispatched[0].body, body);
    plugin.answer(&mut ctx, "created", Some(200), "");
    plugin.answer(&mut ctx, "eu", Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn every_subscriber_skipped_answers_202_at_once() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with(
        "picky.default",
        &[("ce-type", "order.refunded"), ("ce-source", "/us/shop")],
    );
    let _ctx = send(&plugin, &headers, b"{}");
    assert!(plugin.state().dispatched.is_empty());
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn a_request_that_is_not_a_cloudevent_reaches_only_unfiltered_subscribers() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with("orders.default", &[("content-type", "application/json")]);
    let _ctx = send(&plugin, &headers, br#"{"type": "order.created"}"#);
    assert_eq!(clusters(&plugin), ["everything"]);
    let plugin = FakeEnvoy::configured(FILTERED);
    let _ctx = send(&plugin, &post("picky.default"), b"plain text");
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn the_500_report_lists_skipped_subscribers_apart_from_failed() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with("orders.default", &[("ce-type", "order.created")]);
    let mut ctx = send(&plugin, &headers, b"{}");
    assert_eq!(clusters(&plugin), ["created", "everything"]);
    plugin.answer(&mut ctx, "created", Some(503), "busy");
    plugin.answer(&mut ctx, "everything", Some(200), "");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(answer
        .headers
        .contains(&("x-fanout-failed", "1".to_string())));
    let doc = report(&answer);
    assert_eq!(doc["subscribers"], 3);
    assert_eq!(doc["delivered"], 1);
    assert_eq!(doc["failed"][0]["cluster"], "created");
    assert_eq!(doc["skipped"], serde_json::json!(["shipped"]));
    // The metrics tell skipped from failed too.
    let mut plugin = plugin;
    plugin.root.on_tick();
    let state = plugin.state();
    assert_eq!(state.value("fanout.subscriber.shipped.skipped"), 1);
    assert_eq!(state.value("fanout.subscriber.shipped.calls"), 0);
    assert_eq!(
        state.value("fanout.subscriber.created.failed.status_5xx"),
        1
    );
    assert_eq!(state.value("fanout.subscriber.everything.skipped"), 0);
}

#[test]
fn a_batch_is_415_from_the_headers_when_the_channel_filters() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with(
        "orders.default",
        &[("content-type", "application/cloudevents-batch+json")],
    );
    plugin.rejected_from_the_headers(&headers, 415, "batch of CloudEvents");
}

#[test]
fn a_malformed_structured_body_is_400_when_a_filter_needs_it() {
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with("orders.default", &[STRUCTURED]);
    let _ctx = send(&plugin, &headers, br#"{"type": "order.created", "data": "#);
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 400);
    assert!(report(&answer)["error"]
        .as_str()
        .unwrap()
        .contains("not a structured CloudEvent"));
    assert!(plugin.state().dispatched.is_empty());
    // An empty body is no event either.
    let plugin = FakeEnvoy::configured(FILTERED);
    let _ctx = send(&plugin, &headers, b"");
    assert_eq!(plugin.only_answer().status, 400);
}

#[test]
fn without_filters_a_structured_body_is_not_parsed() {
    // A body that is not JSON at all: parsing it would mean a 400.
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with("plain.default", &[STRUCTURED]);
    let mut ctx = send(&plugin, &headers, b"{not json");
    assert_eq!(clusters(&plugin), ["a", "b"]);
    plugin.answer(&mut ctx, "a", Some(200), "");
    plugin.answer(&mut ctx, "b", Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // ...and a batch goes out to all as it is.
    let plugin = FakeEnvoy::configured(FILTERED);
    let headers = with(
        "plain.default",
        &[("content-type", "application/cloudevents-batch+json")],
    );
    let _ctx = send(&plugin, &headers, b"[]");
    assert_eq!(clusters(&plugin), ["a", "b"]);
}

#[test]
fn async_mode_filters_too_and_an_event_nobody_wants_ends_at_once() {
    let config = FILTERED.replacen(
        r#""forward_headers""#,
        r#""mode": "async", "forward_headers""#,
        1,
    );
    let mut plugin = FakeEnvoy::configured(&config);
    let nobody = with("picky.default", &[("ce-type", "order.refunded")]);
    let _ctx = send(&plugin, &nobody, b"{}");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // A tick a second later sends what is due and flushes the metrics.
    plugin.tick_at(1000);
    assert!(plugin.state().dispatched.is_empty());
    // The job ended: nothing stays in flight.
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
    assert_eq!(plugin.state().value("fanout.subscriber.eu.skipped"), 1);

    let created = with("picky.default", &[("ce-type", "order.created")]);
    let _ctx = send(&plugin, &created, b"{}");
    plugin.tick_at(1001);
    assert_eq!(clusters(&plugin), ["created"]);
}
