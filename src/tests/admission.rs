//! What a request gets from its headers and body before anyone is called: 405, 404,
//! 413 (declared or counted), 400, OPTIONS, `require_cloudevents`, how the body is waited
//! for and read (`body_wait`, trailers).

use super::*;
#[test]
fn method_not_allowed_is_405_with_allow_and_no_call() {
    let plugin = FakeEnvoy::configured(THREE);
    let ctx_headers = [(":method", "GET"), (":authority", "orders.default")];
    let _ctx = send(&plugin, &ctx_headers, b"");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 405);
    assert!(answer
        .headers
        .contains(&("allow", "POST, OPTIONS".to_string())));
    assert!(plugin.state().dispatched.is_empty());
}

#[test]
fn options_is_200_with_the_webhook_headers_and_no_call() {
    let mut plugin = FakeEnvoy::configured(THREE);
    let headers = [
        (":method", "OPTIONS"),
        (":authority", "orders.default"),
        ("webhook-request-origin", "sender.example"),
    ];
    let _ctx = send(&plugin, &headers, b"");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 200);
    assert!(answer.body.is_empty());
    for header in [
        ("allow", "POST, OPTIONS"),
        ("webhook-allowed-origin", "sender.example"),
        ("webhook-allowed-rate", "*"),
    ] {
        assert!(answer.header_pairs().contains(&header), "{answer:?}");
    }
    assert!(plugin.state().dispatched.is_empty());
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.requests.options"), 1);
    assert!(plugin
        .state()
        .metric("fanout.requests.rejected.200")
        .is_none());
}

#[test]
fn require_cloudevents_rejects_a_binary_request_from_its_headers() {
    let mut plugin = FakeEnvoy::configured(REQUIRE_CLOUDEVENTS);
    let mut headers = post("x");
    headers.extend([("ce-specversion", "1.0"), ("ce-id", "1"), ("ce-type", "t")]);
    plugin.rejected_from_the_headers(&headers, 400, "ce-source is missing");
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.requests.rejected.400"), 1);

    // The valid one is fanned out.
    headers.push(("ce-source", "/s"));
    let _ctx = send(&plugin, &headers, b"{}");
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn require_cloudevents_rejects_a_structured_body_once_complete() {
    let plugin = FakeEnvoy::configured(REQUIRE_CLOUDEVENTS);
    let mut headers = post("x");
    headers.push(("content-type", "application/cloudevents+json"));
    let _ctx = send(
        &plugin,
        &headers,
        br#"{"specversion": "1.0", "id": "1", "type": "t"}"#,
    );
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 400);
    assert!(report(&answer)["error"]
        .as_str()
        .unwrap()
        .contains("member source is missing"));
    assert!(plugin.state().dispatched.is_empty());
    let valid = br#"{"specversion": "1.0", "id": "1", "source": "/s", "type": "t"}"#;
    let _ctx = send(&plugin, &headers, valid);
    assert_eq!(plugin.state().dispatched.len(), 2);
}

#[test]
fn unknown_host_is_404_and_no_call() {
    let plugin = FakeEnvoy::configured(THREE);
    let _ctx = send(&plugin, &post("nobody.default"), b"{}");
    assert_eq!(plugin.only_answer().status, 404);
    assert!(plugin.state().dispatched.is_empty());
}

// Declared or counted, a body over the limit is 413 and nobody is called.
#[test]
fn declared_body_over_the_limit_is_413_before_the_body() {
    let plugin = FakeEnvoy::configured(THREE);
    let mut headers = post("orders.default");
    headers.push(("content-length", "65"));
    let mut ctx = plugin.stream(&headers, b"");
    assert_eq!(ctx.on_request_headers(false), Flow::Pause);
    assert_eq!(plugin.only_answer().status, 413);
    // The rest of the upload changes nothing.
    assert_eq!(ctx.on_request_body(65, true), Flow::Pause);
    assert_eq!(plugin.answers().len(), 1);
    assert!(plugin.state().dispatched.is_empty());
    assert_eq!(plugin.state().body_reads, 0);
}

#[test]
fn chunked_body_over_the_limit_is_413_as_it_grows() {
    let plugin = FakeEnvoy::configured(THREE);
    let headers = post("orders.default");
    let mut ctx = plugin.stream(&headers, &[b'x'; 100]);
    assert_eq!(ctx.on_request_headers(false), Flow::Pause);
    assert_eq!(ctx.on_request_body(40, false), Flow::Pause);
    assert!(plugin.answers().is_empty());
    assert_eq!(ctx.on_request_body(80, false), Flow::Pause);
    assert_eq!(plugin.only_answer().status, 413);
    assert_eq!(ctx.on_request_body(100, true), Flow::Pause);
    assert_eq!(plugin.answers().len(), 1);
    assert!(plugin.state().dispatched.is_empty());
}

#[test]
fn body_at_the_limit_is_fanned_out() {
    let plugin = FakeEnvoy::configured(THREE);
    let _ctx = send(&plugin, &post("orders.default"), &[b'x'; 64]);
    assert!(plugin.answers().is_empty());
    assert_eq!(plugin.state().dispatched.len(), 3);
    assert_eq!(plugin.state().dispatched[0].body.len(), 64);
}

// A body in several pieces is read once, whole, at end of stream.
#[test]
fn chunked_body_is_read_once_at_end_of_stream() {
    let plugin = FakeEnvoy::configured(THREE);
    let headers = post("orders.default");
    let mut ctx = plugin.stream(&headers, b"hello world");
    ctx.on_request_headers(false);
    ctx.on_request_body(5, false);
    ctx.on_request_body(11, false);
    assert!(plugin.state().dispatched.is_empty());
    ctx.on_request_body(11, true);
    let state = plugin.state();
    assert_eq!(state.body_reads, 1);
    assert_eq!(state.dispatched.len(), 3);
    assert_eq!(state.dispatched[2].body, b"hello world");
}

#[test]
fn trailers_end_the_request() {
    let plugin = FakeEnvoy::configured(THREE);
    let headers = post("orders.default");
    let mut ctx = plugin.stream(&headers, b"data");
    ctx.on_request_headers(false);
    ctx.on_request_body(4, false);
    assert_eq!(ctx.on_request_trailers(), Flow::Pause);
    assert_eq!(plugin.state().dispatched.len(), 3);
    assert_eq!(plugin.state().dispatched[0].body, b"data");
}

#[test]
fn request_without_body_fans_out_from_the_headers() {
    let plugin = FakeEnvoy::configured(THREE);
    let _ctx = send(&plugin, &post("orders.default"), b"");
    let state = plugin.state();
    assert_eq!(state.dispatched.len(), 3);
    assert!(state.dispatched[0].body.is_empty());
    assert_eq!(state.body_reads, 0);
}

#[test]
fn a_forwarded_value_that_is_not_utf8_goes_on_as_it_came() {
    let plugin = FakeEnvoy::configured(THREE);
    let mut ctx = plugin.stream(&post("orders.default"), b"");
    plugin
        .host
        .0
        .borrow_mut()
        .request_headers
        .push(("ce-source".into(), vec![0xc3, 0x28]));
    ctx.on_request_headers(true);
    assert!(plugin.answers().is_empty());
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 3);
    for call in calls {
        assert_eq!(call.header("ce-source"), Some(&[0xc3, 0x28][..]));
    }
}

// body_wait: continue lets the headers on (to a buffer filter) and still fans out the body.
#[test]
fn continue_mode_lets_headers_on_and_fans_out_at_end_of_stream() {
    let plugin =
        FakeEnvoy::configured(r#"{"body_wait": "continue", "subscribers": [{"cluster": "a"}]}"#);
    let headers = post("x");
    let mut ctx = plugin.stream(&headers, b"event");
    assert_eq!(ctx.on_request_headers(false), Flow::Continue);
    assert_eq!(ctx.on_request_body(5, false), Flow::Pause);
    assert_eq!(ctx.on_request_body(5, true), Flow::Pause);
    assert_eq!(plugin.state().dispatched[0].body, b"event");
    plugin.answer(&mut ctx, "a", Some(200), "");
    assert_eq!(plugin.only_answer(), Answer::accepted());
    // Our own local reply passes through the response path: nothing to flag.
    assert_eq!(ctx.on_response_headers(), Flow::Continue);
}

#[test]
fn continue_mode_still_pauses_rejections_and_bodyless_requests() {
    let plugin =
        FakeEnvoy::configured(r#"{"body_wait": "continue", "subscribers": [{"cluster": "a"}]}"#);
    let get = [(":method", "GET"), (":authority", "x")];
    let mut ctx = plugin.stream(&get, b"");
    assert_eq!(ctx.on_request_headers(false), Flow::Pause);
    assert_eq!(plugin.only_answer().status, 405);
    let headers = post("x");
    let mut ctx = plugin.stream(&headers, b"");
    assert_eq!(ctx.on_request_headers(true), Flow::Pause);
    assert_eq!(plugin.state().dispatched.len(), 1);
}

#[test]
fn a_response_before_our_answer_means_the_router_was_reached() {
    let mut plugin =
        FakeEnvoy::configured(r#"{"body_wait": "continue", "subscribers": [{"cluster": "a"}]}"#);
    let headers = post("x");
    let mut ctx = plugin.stream(&headers, b"event");
    assert_eq!(ctx.on_request_headers(false), Flow::Continue);
    // No buffer filter: the route answers before the body is in.
    assert_eq!(ctx.on_response_headers(), Flow::Continue);
    assert_eq!(ctx.on_request_body(5, true), Flow::Pause);
    assert!(plugin.state().dispatched.is_empty(), "fanned out anyway");
    assert!(plugin.answers().is_empty());
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.requests.reached_router"), 1);
}
