//! `on_configure`: refused configurations, updates (streams keep the configuration they
//! started with), a stream without one, and the root contexts of one VM sharing their work.

use super::*;

#[test]
fn streams_keep_the_config_they_started_with() {
    let (mut plugin, ok) = FakeEnvoy::configure(r#"{"subscribers": [{"cluster": "old"}]}"#);
    assert!(ok);
    let mut before = plugin.stream(&post("x"), b"");
    // A new configuration arrives (as an xDS update would deliver it).
    plugin.host.0.borrow_mut().config = Some(br#"{"subscribers": [{"cluster": "new"}]}"#.to_vec());
    assert!(plugin.root.on_configure());
    before.on_request_headers(true);
    let _after = send(&plugin, &post("x"), b"");
    let clusters: Vec<String> = plugin
        .state()
        .dispatched
        .iter()
        .map(|c| c.cluster.clone())
        .collect();
    assert_eq!(clusters, ["old", "new"]);
}

#[test]
fn an_invalid_update_is_refused_and_the_old_config_serves() {
    let (mut plugin, ok) = FakeEnvoy::configure(r#"{"subscribers": [{"cluster": "old"}]}"#);
    assert!(ok);
    plugin.host.0.borrow_mut().config = Some(br#"{"subscribers": [{"cluster": ""}]}"#.to_vec());
    assert!(!plugin.root.on_configure());
    let _ctx = send(&plugin, &post("x"), b"");
    assert_eq!(plugin.state().dispatched[0].cluster, "old");
}

// Every config rejection of the contract makes on_configure refuse.
#[test]
fn config_rejections_are_refused_by_on_configure() {
    let cases = [
        "",
        "{}",
        r#"{"subscribers": [{"cluster": "a"}], "unknown": true}"#,
        r#"{"subscribers": [{"cluster": 5}]}"#,
        r#"{"subscribers": [{"cluster": ""}]}"#,
        r#"{"subscribers": [{"cluster": "a", "path": "x"}]}"#,
        r#"{"subscribers": [{"cluster": "a", "timeout_ms": 0}]}"#,
        r#"{"timeout_ms": 0, "subscribers": []}"#,
        r#"{"channels": [{"hosts": ["a"]}, {"hosts": ["a"]}]}"#,
        r#"{"channels": [], "subscribers": []}"#,
    ];
    for json in cases {
        let (_plugin, ok) = FakeEnvoy::configure(json);
        assert!(!ok, "accepted: {json:?}");
    }
    let (_plugin, ok) = FakeEnvoy::configure(THREE);
    assert!(ok);
}

#[test]
fn a_stream_without_configuration_answers_500() {
    let (plugin, ok) = FakeEnvoy::configure("{}");
    assert!(!ok);
    let _ctx = send(&plugin, &post("x"), b"");
    let answer = plugin.only_answer();
    assert_eq!(answer.status, 500);
    assert!(plugin.state().dispatched.is_empty());
}

#[test]
fn filter_config_errors_are_refused_by_on_configure() {
    for json in [
        r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"type": "t", "id": "1"}}]}]}"#,
        r#"{"subscribers": [{"cluster": "a", "filters": [{"like": {"type": "t"}}]}]}"#,
        r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"": "t"}}]}]}"#,
        r#"{"subscribers": [{"cluster": "a", "filter": {"attributes": {"type": 1}}}]}"#,
    ] {
        let (_plugin, ok) = FakeEnvoy::configure(json);
        assert!(!ok, "accepted: {json}");
    }
}

/// A configuration update starts a new root context in the same VM; a request that started
/// under the old one is counted, and its deliveries go on.
#[test]
fn root_contexts_of_one_vm_share_counts_and_deliveries() {
    let host = FakeHost::default();
    let json = br#"{"delivery": {"retry": 1, "backoff_delay_ms": 100},
                    "subscribers": [{"cluster": "a"}]}"#;
    host.0.borrow_mut().config = Some(json.to_vec());
    let shared = VmShared::default();
    let mut old = Plugin::with_shared(ROOT, host.clone(), shared.clone());
    assert!(old.on_configure());
    host.0.borrow_mut().request_headers = post("x")
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    host.0.borrow_mut().effective = STREAM;
    let mut ctx = old.create_stream(STREAM);
    ctx.on_request_headers(true);
    host.0.borrow_mut().call_response = (Some(503), Vec::new());
    ctx.on_call_response(host.token_of("a"), 1, 0);

    // The update: a new root in the same VM; the old one is retired.
    let mut new = Plugin::with_shared(ROOT + 10, host.clone(), shared);
    assert!(new.on_configure());
    assert!(old.on_done());
    drop(old);
    // exponential by default: 100 ms * 2^1 before retry 1
    host.0.borrow_mut().now_ms = 200;
    host.0.borrow_mut().effective = ROOT + 10;
    new.on_tick();
    let calls = host.0.borrow().dispatched.clone();
    assert!(
        calls.len() == 2 && calls[1].cluster == "a" && calls[1].context == ROOT + 10,
        "the new root's timer sent the old request's retry: {calls:?}"
    );
    host.0.borrow_mut().call_response = (Some(200), Vec::new());
    new.on_call_response(host.token_of("a"), 1, 0);
    assert_eq!(host.0.borrow().answers, vec![Answer::accepted()]);
    host.0.borrow_mut().now_ms = 2000;
    new.on_tick();
    let state = host.0.borrow();
    assert_eq!(state.value("fanout.requests.accepted"), 1);
    assert_eq!(state.value("fanout.requests.received"), 1);
    assert_eq!(state.value("fanout.in_flight"), 0);
    assert_eq!(state.value("fanout.subscriber.a.retries"), 1);
}
