//! Metrics: defined at configure, counted in memory, handed to the fake host's stats on
//! the root context's tick.

use super::*;

// Metrics: counted in memory, handed to Envoy on the root's tick.
#[test]
fn metrics_are_defined_at_configure_and_flushed_on_tick() {
    let mut plugin = FakeEnvoy::configured(THREE);
    {
        let state = plugin.state();
        assert_eq!(state.tick_period, Some(Duration::from_secs(1)));
        for name in [
            "fanout.requests.received",
            "fanout.requests.accepted",
            "fanout.requests.failed",
            "fanout.requests.options",
            "fanout.subscriber.billing.calls",
            "fanout.subscriber.shipping.delivered",
            "fanout.subscriber.analytics.failed.timeout",
            "fanout.in_flight",
        ] {
            assert_eq!(state.value(name), 0, "{name}");
        }
        assert!(state.samples("fanout.duration_ms").is_empty());
    }

    // One fan-out: billing 200 after 5 ms, shipping 500 after 7 ms, analytics times out.
    plugin.host.0.borrow_mut().now_ms = 1000;
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.in_flight"), 1);
    assert_eq!(plugin.state().value("fanout.subscriber.billing.calls"), 1);
    plugin.host.0.borrow_mut().now_ms = 1005;
    plugin.answer(&mut ctx, "billing", Some(200), "");
    plugin.host.0.borrow_mut().now_ms = 1007;
    plugin.answer(&mut ctx, "shipping", Some(500), "");
    plugin.host.0.borrow_mut().now_ms = 1010;
    plugin.answer(&mut ctx, "analytics", Some(504), "upstream request timeout");
    // A rejection and a success with no subscribers.
    let _r = send(&plugin, &post("nobody"), b"{}");
    let _e = send(&plugin, &post("empty.default"), b"");
    plugin.root.on_tick();

    let state = plugin.state();
    let expected = [
        ("fanout.requests.received", 3),
        ("fanout.requests.accepted", 1),
        ("fanout.requests.failed", 1),
        ("fanout.requests.rejected.404", 1),
        ("fanout.subscriber.billing.calls", 1),
        ("fanout.subscriber.billing.delivered", 1),
        ("fanout.subscriber.shipping.failed.status_5xx", 1),
        ("fanout.subscriber.analytics.failed.timeout", 1),
        ("fanout.subscriber.analytics.delivered", 0),
        ("fanout.in_flight", 0),
    ];
    for (name, value) in expected {
        assert_eq!(state.value(name), value, "{name}");
    }
    assert_eq!(state.samples("fanout.call_duration_ms"), vec![5, 7, 10]);
    assert_eq!(state.samples("fanout.duration_ms"), vec![10, 0]);
}

#[test]
fn a_client_that_goes_away_leaves_the_in_flight_gauge() {
    let mut plugin = FakeEnvoy::configured(THREE);
    let mut ctx = send(&plugin, &post("orders.default"), b"{}");
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.in_flight"), 1);
    assert!(ctx.on_done());
    plugin.root.on_tick();
    assert_eq!(plugin.state().value("fanout.in_flight"), 0);
    assert!(plugin.state().samples("fanout.duration_ms").is_empty());
}

#[test]
fn metrics_off_defines_and_counts_nothing() {
    let mut plugin =
        FakeEnvoy::configured(r#"{"metrics": false, "subscribers": [{"cluster": "a"}]}"#);
    let mut ctx = send(&plugin, &post("x"), b"e");
    plugin.answer(&mut ctx, "a", Some(200), "");
    plugin.root.on_tick();
    let state = plugin.state();
    assert!(state.metrics.is_empty(), "{:?}", state.metrics);
    assert_eq!(state.tick_period.unwrap_or_default(), Duration::ZERO);
    assert_eq!(state.answers.len(), 1);
}

#[test]
fn odd_cluster_names_make_one_stat_segment() {
    let plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "outbound|80||billing.default.svc.cluster.local"}]}"#,
    );
    assert_eq!(
        plugin
            .state()
            .value("fanout.subscriber.outbound_80__billing_default_svc_cluster_local.calls"),
        0
    );
}
