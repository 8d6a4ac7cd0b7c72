use super::*;
use crate::call_slots::DEFAULT_MAX_QUEUED_CALLS;
use crate::retry::DEFAULT_BACKOFF_MAX_MS;

fn parse(json: &str) -> Result<Config, ConfigError> {
    Config::from_json(json.as_bytes())
}

fn error(json: &str) -> String {
    match parse(json) {
        Ok(_) => panic!("config was accepted: {json}"),
        Err(e) => e.to_string(),
    }
}

/// Each config is refused with a message containing its expected text.
fn assert_rejected(cases: &[(&str, &str)]) {
    for (json, expected) in cases {
        let message = error(json);
        assert!(
            message.contains(expected),
            "config {json}\n  gave: {message}\n  want: ...{expected}..."
        );
    }
}

#[test]
fn subscribers_are_required_unless_they_say_otherwise() {
    let config = parse(
        r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b", "required": false},
                            {"cluster": "c", "required": true}]}"#,
    )
    .unwrap();
    let required: Vec<bool> = config.channels[0]
        .subscribers
        .iter()
        .map(|s| s.required)
        .collect();
    assert_eq!(required, [true, false, true]);
    assert!(!config.channels[0].all_best_effort());
    // Best-effort calls go out on the root context's timer.
    assert!(config.needs_timer);
    let config = parse(r#"{"subscribers": [{"cluster": "a", "required": false}]}"#).unwrap();
    assert!(config.channels[0].all_best_effort());
}

#[test]
fn required_rejections_name_the_field() {
    assert_rejected(&[
        (
            r#"{"subscribers": [{"cluster": "a", "required": "no"}]}"#,
            "subscribers[0].required: invalid type: string \"no\", expected a boolean",
        ),
        (
            r#"{"required": false, "subscribers": []}"#,
            "required: unknown field `required`",
        ),
        (
            r#"{"channels": [{"required": false, "subscribers": []}]}"#,
            "channels[0].required: unknown field `required`",
        ),
    ]);
}

#[test]
fn call_caps_are_off_by_default_and_fall_back_to_the_top_level() {
    let config = parse(r#"{"subscribers": [{"cluster": "a"}]}"#).unwrap();
    assert_eq!(config.channels[0].subscribers[0].call_cap, None);
    assert!(config.call_caps.is_empty());

    let config = parse(
        r#"{
          "max_concurrent_calls": 4,
          "channels": [
            { "name": "orders", "hosts": ["orders"], "subscribers": [
              { "cluster": "a" },
              { "cluster": "b", "max_concurrent_calls": 2, "max_queued_calls": 5 },
              { "cluster": "c", "max_queued_calls": 0 },
              { "cluster": "a", "path": "/other" }
            ] },
            { "name": "audit", "hosts": ["audit"], "subscribers": [
              { "cluster": "b", "max_concurrent_calls": 2, "max_queued_calls": 5 }
            ] }
          ]
        }"#,
    )
    .unwrap();
    let cap = |max_concurrent_calls, max_queued_calls| {
        Some(CallCap {
            max_concurrent_calls,
            max_queued_calls,
        })
    };
    let caps: Vec<Option<CallCap>> = config
        .channels
        .iter()
        .flat_map(|c| &c.subscribers)
        .map(|s| s.call_cap)
        .collect();
    assert_eq!(
        caps,
        [
            cap(4, DEFAULT_MAX_QUEUED_CALLS),
            cap(2, 5),
            cap(4, 0),
            cap(4, DEFAULT_MAX_QUEUED_CALLS),
            cap(2, 5),
        ]
    );
    // One entry per cluster, in the order the clusters first appear.
    let by_cluster: Vec<(&str, Option<CallCap>)> = config
        .call_caps
        .iter()
        .map(|(cluster, cap)| (cluster.as_str(), Some(*cap)))
        .collect();
    assert_eq!(
        by_cluster,
        [
            ("a", cap(4, DEFAULT_MAX_QUEUED_CALLS)),
            ("b", cap(2, 5)),
            ("c", cap(4, 0))
        ]
    );

    // A top-level queue limit applies to the subscribers that have a cap of their own.
    let config = parse(
        r#"{"max_queued_calls": 7, "subscribers": [
             {"cluster": "a", "max_concurrent_calls": 1}, {"cluster": "b"}]}"#,
    )
    .unwrap();
    let subs = &config.channels[0].subscribers;
    assert_eq!((subs[0].call_cap, subs[1].call_cap), (cap(1, 7), None));
}

#[test]
fn call_cap_rejections_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"max_concurrent_calls": 0, "subscribers": [{"cluster": "a"}]}"#,
            "max_concurrent_calls: must be at least 1",
        ),
        (
            r#"{"max_concurrent_calls": -1, "subscribers": []}"#,
            "max_concurrent_calls: invalid value: integer `-1`",
        ),
        (
            r#"{"max_concurrent_calls": 4294967296, "subscribers": []}"#,
            "max_concurrent_calls: invalid value: integer `4294967296`",
        ),
        (
            r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b", "max_concurrent_calls": 0}]}"#,
            "subscribers[1].max_concurrent_calls: must be at least 1",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "max_concurrent_calls": 1, "max_queued_calls": -5}]}"#,
            "subscribers[0].max_queued_calls: invalid value: integer `-5`",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "max_queued_calls": 10}]}"#,
            "subscribers[0].max_queued_calls: has no effect without max_concurrent_calls",
        ),
        (
            r#"{"max_queued_calls": 10, "subscribers": [{"cluster": "a"}]}"#,
            "max_queued_calls: has no effect without max_concurrent_calls",
        ),
        (
            r#"{"channels": [
                 {"name": "x", "hosts": ["x"], "subscribers": [{"cluster": "billing", "max_concurrent_calls": 4}]},
                 {"name": "y", "hosts": ["y"], "subscribers": [{"cluster": "billing"}]}]}"#,
            "channels[1].subscribers[0].max_concurrent_calls: cluster \"billing\" has no \
             max_concurrent_calls here but max_concurrent_calls 4 and max_queued_calls 1000 \
             in channels[0].subscribers[0]: the subscribers of one cluster share its cap",
        ),
        (
            r#"{"max_concurrent_calls": 2, "subscribers": [
                 {"cluster": "a"}, {"cluster": "a", "path": "/b", "max_queued_calls": 3}]}"#,
            "subscribers[1].max_queued_calls: cluster \"a\" has max_concurrent_calls 2 and \
             max_queued_calls 3 here but max_concurrent_calls 2 and max_queued_calls 1000 in \
             subscribers[0]",
        ),
    ];
    assert_rejected(cases);
}

#[test]
fn backoff_jitter_is_none_unless_set_and_a_subscriber_overrides_it() {
    let config = parse(
        r#"{"delivery": {"retry": 2, "backoff_jitter": 0.2}, "subscribers": [
             {"cluster": "a"},
             {"cluster": "b", "delivery": {"backoff_jitter": 1}},
             {"cluster": "c", "delivery": {"retry": 1}}]}"#,
    )
    .unwrap();
    let jitter: Vec<f64> = config.channels[0]
        .subscribers
        .iter()
        .map(|s| s.backoff_jitter.fraction())
        .collect();
    assert_eq!(jitter, [0.2, 1.0, 0.2]);
    let config = parse(r#"{"subscribers": [{"cluster": "a"}]}"#).unwrap();
    assert_eq!(
        config.channels[0].subscribers[0].backoff_jitter,
        Jitter::NONE
    );
}

#[test]
fn backoff_jitter_rejections_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"delivery": {"backoff_jitter": 1.5}, "subscribers": []}"#,
            "delivery.backoff_jitter: must be from 0.0 (no jitter) to 1.0",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "delivery": {"backoff_jitter": -0.1}}]}"#,
            "subscribers[0].delivery.backoff_jitter: must be from 0.0",
        ),
        (
            r#"{"channels": [{"subscribers": [{"cluster": "a", "delivery": {"backoff_jitter": 2}}]}]}"#,
            "channels[0].subscribers[0].delivery.backoff_jitter: must be from 0.0",
        ),
        (
            r#"{"delivery": {"backoff_jitter": "0.5"}, "subscribers": []}"#,
            "delivery.backoff_jitter: invalid type: string \"0.5\", expected f64",
        ),
        (
            r#"{"delivery": {"backoff_jitter": NaN}, "subscribers": []}"#,
            "the plugin configuration is not valid JSON",
        ),
        (
            r#"{"delivery": {"backoff_jitter": 1e999}, "subscribers": []}"#,
            "the plugin configuration is not valid JSON: number out of range",
        ),
    ];
    assert_rejected(cases);
}

#[test]
fn full_example_from_the_readme_is_accepted() {
    let config = parse(
        r#"{
          "timeout_ms": 60000, "max_body_bytes": 1048576, "methods": ["POST"],
          "forward_headers": ["content-type", "x-request-id", "traceparent", "tracestate",
                              "ce-*", "knative-*", "x-b3-*"],
          "channels": [
            { "name": "default/orders",
              "hosts": ["orders.default", "orders.default.svc.cluster.local"],
              "subscribers": [
                { "cluster": "billing", "authority": "billing.default.svc.cluster.local",
                  "path": "/events", "timeout_ms": 2000, "headers": { "x-tenant": "acme" } }
              ] }
          ]
        }"#,
    )
    .unwrap();
    let channel = &config.channels[0];
    assert_eq!(channel.name, "default/orders");
    let sub = &channel.subscribers[0];
    assert_eq!(sub.cluster, "billing");
    assert_eq!(sub.timeout, Duration::from_millis(2000));
    assert_eq!(
        sub.call_headers,
        vec![
            (":method".to_string(), "POST".to_string()),
            (":path".to_string(), "/events".to_string()),
            (
                ":authority".to_string(),
                "billing.default.svc.cluster.local".to_string()
            ),
            ("x-tenant".to_string(), "acme".to_string()),
        ]
    );
    assert_eq!(config.router.route("orders.default"), Some(0));
    assert_eq!(config.router.route("other"), None);
}

#[test]
fn defaults_fill_every_field_but_cluster() {
    let config = parse(r#"{"subscribers": [{"cluster": "a"}]}"#).unwrap();
    assert_eq!(config.methods, vec!["POST"]);
    assert_eq!(config.allow, "POST, OPTIONS");
    assert_eq!(config.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    assert!(config.forward.selects("ce-type"));
    assert!(config.forward.selects("x-b3-traceid"));
    assert!(!config.forward.selects("authorization"));
    let sub = &config.channels[0].subscribers[0];
    assert_eq!(sub.authority, "a");
    assert_eq!(sub.path, "/");
    assert_eq!(
        sub.timeout,
        Duration::from_millis(u64::from(DEFAULT_TIMEOUT_MS))
    );
    assert_eq!(config.router.route("anything.at.all"), Some(0));
}

#[test]
fn top_level_timeout_is_the_default_and_a_subscriber_timeout_wins() {
    let config = parse(
        r#"{"timeout_ms": 700, "subscribers": [{"cluster": "a"}, {"cluster": "b", "timeout_ms": 5}]}"#,
    )
    .unwrap();
    let subs = &config.channels[0].subscribers;
    assert_eq!(subs[0].timeout, Duration::from_millis(700));
    assert_eq!(subs[1].timeout, Duration::from_millis(5));
}

#[test]
fn empty_subscriber_list_is_a_valid_channel() {
    let config = parse(r#"{"subscribers": []}"#).unwrap();
    assert!(config.channels[0].subscribers.is_empty());
}

/// Every rejection names the field path and says what would be valid.
#[test]
fn rejections_name_the_field() {
    let cases: &[(&str, &str)] = &[
        ("", "the plugin configuration is empty"),
        ("  \n", "the plugin configuration is empty"),
        ("{}", "no channels"),
        ("[]", "must be a JSON object"),
        ("not json", "must be a JSON object"),
        (
            "{not json",
            "the plugin configuration is not valid JSON: key must be a string at line 1 column 2",
        ),
        (
            r#"{"subscribers": [{"cluster": "a"}]"#,
            "not valid JSON: EOF while parsing an object at line 1",
        ),
        (
            r#"{"subscribers": [{"cluster": "a"}]} trailing"#,
            "not valid JSON: trailing characters at line 1",
        ),
        (
            r#"{"subscribers": [{"cluster": "a"}], "bogus": 1}"#,
            "unknown field `bogus`",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "clutser": "b"}]}"#,
            "subscribers[0].clutser: unknown field `clutser`, expected one of `cluster`",
        ),
        (
            r#"{"channels": [{"subscribers": [{"cluster": "a"}, {"cluster": "b"}, {"cluster": ""}]}]}"#,
            "channels[0].subscribers[2].cluster: must not be empty",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "timeout_ms": "fast"}]}"#,
            "subscribers[0].timeout_ms: invalid type: string \"fast\"",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "timeout_ms": 0}]}"#,
            "subscribers[0].timeout_ms: must be at least 1",
        ),
        (
            r#"{"timeout_ms": 0, "subscribers": []}"#,
            "timeout_ms: must be at least 1",
        ),
        (
            r#"{"timeout_ms": -5, "subscribers": []}"#,
            "timeout_ms: invalid value: integer `-5`",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "path": "events"}]}"#,
            "subscribers[0].path: must start with \"/\"",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "path": "/a b"}]}"#,
            "subscribers[0].path: must not contain spaces",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "authority": "x\r\ny: z"}]}"#,
            "subscribers[0].authority: must be a host name",
        ),
        (
            r#"{"subscribers": [{"cluster": "a"}], "channels": []}"#,
            "subscribers: cannot be used together with `channels`",
        ),
        (
            r#"{"channels": [{"name": "x", "hosts": ["a.b"]}, {"name": "y", "hosts": ["c", "A.B"]}]}"#,
            "channels[1].hosts[1]: \"a.b\" is already claimed by channels[0]",
        ),
        (
            r#"{"channels": [{"name": "x"}, {"name": "y"}]}"#,
            "channels[1].hosts[0]: \"*\" is already claimed by channels[0]",
        ),
        (
            r#"{"channels": [{"name": "x", "hosts": ["a"]}, {"name": "x", "hosts": ["b"]}]}"#,
            "channels[1].name: \"x\" is already the name of channels[0]",
        ),
        (
            r#"{"channels": [{"hosts": []}]}"#,
            "channels[0].hosts: must list at least one host",
        ),
        (
            r#"{"channels": [{"hosts": ["orders:8080"]}]}"#,
            "channels[0].hosts[0]: must not contain a port",
        ),
        (
            r#"{"channels": [{"hosts": [""]}]}"#,
            "channels[0].hosts[0]: must not be empty",
        ),
        (
            r#"{"methods": [], "subscribers": []}"#,
            "methods: must list at least one",
        ),
        (
            r#"{"methods": ["post"], "subscribers": []}"#,
            "methods[0]: \"post\" is not an upper-case HTTP method",
        ),
        (
            r#"{"forward_headers": ["ok", "bad header"], "subscribers": []}"#,
            "forward_headers[1]:",
        ),
        (
            r#"{"forward_headers": ["content-length"], "subscribers": []}"#,
            "forward_headers[0]: \"content-length\" is never forwarded",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "headers": {"content-length": "5"}}]}"#,
            "subscribers[0].headers.content-length:",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "headers": {":path": "/x"}}]}"#,
            "subscribers[0].headers.:path:",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "headers": {"x-a": "1\r\nx-b: 2"}}]}"#,
            "subscribers[0].headers.x-a: the value must not contain",
        ),
    ];
    for (json, expected) in cases {
        let message = error(json);
        assert!(
            message.contains(expected),
            "config {json:?}\n  gave: {message}\n  want: ...{expected}..."
        );
        assert!(
            !message.contains(" at line ") || message.contains("not valid JSON"),
            "position leaked into {message}"
        );
        assert!(!message.starts_with('?'), "{message}");
    }
}

#[test]
fn extra_header_names_are_lower_cased() {
    let config =
        parse(r#"{"subscribers": [{"cluster": "a", "headers": {"X-Tenant": "Acme"}}]}"#).unwrap();
    let headers = &config.channels[0].subscribers[0].call_headers;
    assert_eq!(headers[3], ("x-tenant".to_string(), "Acme".to_string()));
}

#[test]
fn extra_headers_keep_their_order_and_a_repeated_name_its_last_value() {
    let config = parse(
        r#"{"subscribers": [{"cluster": "a",
            "headers": {"x-b": "1", "x-a": "2", "x-b": "3"}}]}"#,
    )
    .unwrap();
    let headers = &config.channels[0].subscribers[0].call_headers;
    let pair = |n: &str, v: &str| (n.to_string(), v.to_string());
    assert_eq!(headers[3..], [pair("x-b", "3"), pair("x-a", "2")]);
    assert_eq!(
        error(r#"{"subscribers": [{"cluster": "a", "headers": ["x-a"]}]}"#),
        "subscribers[0].headers: invalid type: sequence, expected a map"
    );
}

#[test]
fn delivery_defaults_and_subscriber_overrides() {
    let config = parse(
        r#"{
          "delivery": { "retry": 3, "backoff_policy": "linear", "backoff_delay_ms": 50,
                        "dead_letter": { "cluster": "dlq", "authority": "dlq.local" } },
          "reply": { "cluster": "replies" },
          "subscribers": [
            { "cluster": "a" },
            { "cluster": "b", "delivery": { "retry": 1 } },
            { "cluster": "c", "reply": { "cluster": "own", "path": "/r" } }
          ]
        }"#,
    )
    .unwrap();
    let subs = &config.channels[0].subscribers;
    assert_eq!(subs[0].retry.retry, 3);
    assert_eq!(subs[0].retry.policy, BackoffPolicy::Linear);
    assert_eq!(subs[0].retry.delay_ms, 50);
    assert_eq!(subs[0].retry.max_ms, DEFAULT_BACKOFF_MAX_MS);
    let dlq = subs[0].dead_letter.as_ref().unwrap();
    assert_eq!(
        (dlq.cluster.as_str(), dlq.authority.as_str()),
        ("dlq", "dlq.local")
    );
    assert_eq!(subs[0].reply.as_ref().unwrap().cluster, "replies");
    // b overrides retry only: the rest comes from the top level.
    assert_eq!(subs[1].retry.retry, 1);
    assert_eq!(subs[1].retry.policy, BackoffPolicy::Linear);
    assert_eq!(subs[1].dead_letter.as_ref().unwrap().cluster, "dlq");
    assert_eq!(subs[2].reply.as_ref().unwrap().path, "/r");
    assert!(config.needs_timer);
    assert_eq!(config.mode, AnswerMode::Sync);
}

#[test]
fn plain_config_needs_no_timer_and_async_does() {
    assert!(
        !parse(r#"{"subscribers": [{"cluster": "a"}]}"#)
            .unwrap()
            .needs_timer
    );
    let config = parse(r#"{"mode": "async", "subscribers": [{"cluster": "a"}]}"#).unwrap();
    assert!(config.needs_timer);
    assert_eq!(config.mode, AnswerMode::Async);
    assert_eq!(config.max_in_flight, DEFAULT_MAX_IN_FLIGHT as usize);
}

#[test]
fn delivery_rejections_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"delivery": {"retry": 101}, "subscribers": []}"#,
            "delivery.retry: at most 100 retries",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "delivery": {"retry": 1000}}]}"#,
            "subscribers[0].delivery.retry: at most 100 retries",
        ),
        (
            r#"{"delivery": {"backoff_policy": "random"}, "subscribers": []}"#,
            "delivery.backoff_policy: unknown variant `random`, expected `linear` or `exponential`",
        ),
        (
            r#"{"delivery": {"dead_letter": {"cluster": ""}}, "subscribers": []}"#,
            "delivery.dead_letter.cluster: must not be empty",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "delivery": {"dead_letter": {"cluster": "d", "path": "x"}}}]}"#,
            "subscribers[0].delivery.dead_letter.path: must start with",
        ),
        (
            r#"{"reply": {"cluster": "r", "timeout_ms": 0}, "subscribers": []}"#,
            "reply.timeout_ms: must be at least 1",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "reply": {"path": "/"}}]}"#,
            "subscribers[0].reply: missing field `cluster`",
        ),
        (
            r#"{"delivery": {"retries": 3}, "subscribers": []}"#,
            "delivery.retries: unknown field `retries`",
        ),
        (
            r#"{"mode": "later", "subscribers": []}"#,
            "mode: unknown variant `later`, expected `sync` or `async`",
        ),
        (
            r#"{"mode": "async", "max_in_flight": 0, "subscribers": []}"#,
            "max_in_flight: must be at least 1",
        ),
    ];
    assert_rejected(cases);
}

#[test]
fn delivery_format_by_subscriber_falls_back_to_the_top_level() {
    let config = parse(
        r#"{"delivery": {"format": "json"}, "channels": [
             {"name": "c", "hosts": ["c"], "subscribers": [
               {"cluster": "a"},
               {"cluster": "b", "delivery": {"format": "binary"}},
               {"cluster": "c", "delivery": {"retry": 1}}]},
             {"name": "d", "hosts": ["d"], "subscribers": [{"cluster": "e"}]}]}"#,
    )
    .unwrap();
    let formats: Vec<_> = config.channels[0]
        .subscribers
        .iter()
        .map(|s| s.format)
        .collect();
    assert_eq!(
        formats,
        [
            Some(Format::Structured),
            Some(Format::Binary),
            Some(Format::Structured)
        ]
    );
    assert!(config.channels[0].converts && config.channels[1].converts);
    let plain = parse(r#"{"subscribers": [{"cluster": "a"}]}"#).unwrap();
    assert_eq!(plain.channels[0].subscribers[0].format, None);
    assert!(!plain.channels[0].converts);
}

#[test]
fn delivery_format_rejections_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"delivery": {"format": "xml"}, "subscribers": []}"#,
            "delivery.format: \"xml\" is not a content mode: use \"binary\", \"structured\" or \"json\"",
        ),
        (
            r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b", "delivery": {"format": "JSON"}}]}"#,
            "subscribers[1].delivery.format: \"JSON\" is not a content mode",
        ),
        (
            r#"{"channels": [{"subscribers": [{"cluster": "a", "delivery": {"format": 1}}]}]}"#,
            "channels[0].subscribers[0].delivery.format: invalid type: integer `1`, expected a string",
        ),
        (
            r#"{"forward_headers": ["x-request-id", "ce-*"],
                "subscribers": [{"cluster": "a"}, {"cluster": "b", "delivery": {"format": "binary"}}]}"#,
            "forward_headers: does not forward content-type, which subscribers[1] needs for its delivery.format",
        ),
    ];
    assert_rejected(cases);
    // The same list without a format is fine.
    assert!(parse(r#"{"forward_headers": ["ce-*"], "subscribers": [{"cluster": "a"}]}"#).is_ok());
}

#[test]
fn a_sync_delivery_longer_than_envoys_idle_timeout_is_warned_about() {
    let config = parse(
        r#"{"delivery": {"retry": 10}, "subscribers": [{"cluster": "slow", "timeout_ms": 60000}]}"#,
    )
    .unwrap();
    assert_eq!(config.warnings.len(), 1);
    assert!(
        config.warnings[0].contains("subscriber slow may take up to"),
        "{:?}",
        config.warnings
    );
    let config = parse(
        r#"{"mode": "async", "delivery": {"retry": 10}, "subscribers": [{"cluster": "slow", "timeout_ms": 60000}]}"#,
    )
    .unwrap();
    assert!(config.warnings.is_empty());
}

#[test]
fn report_is_failures_unless_full() {
    let config = parse(r#"{"subscribers": []}"#).unwrap();
    assert_eq!(config.report, ReportDetail::Failures);
    let config = parse(r#"{"report": "full", "subscribers": []}"#).unwrap();
    assert_eq!(config.report, ReportDetail::Full);
    assert!(error(r#"{"report": "all", "subscribers": []}"#)
        .contains("report: unknown variant `all`, expected `failures` or `full`"));
}

#[test]
fn body_wait_is_pause_unless_set() {
    let config = parse(r#"{"subscribers": []}"#).unwrap();
    assert_eq!(config.body_wait, BodyWait::Pause);
    let config = parse(r#"{"body_wait": "continue", "subscribers": []}"#).unwrap();
    assert_eq!(config.body_wait, BodyWait::Continue);
    let message = error(r#"{"body_wait": "wait", "subscribers": []}"#);
    assert!(
        message.contains("body_wait: unknown variant `wait`, expected `pause` or `continue`"),
        "{message}"
    );
}

#[test]
fn filters_compile_at_configure_time_and_mark_the_channel() {
    let config = parse(
        r#"{"channels": [
             {"name": "orders", "hosts": ["orders"], "subscribers": [
               {"cluster": "a", "filters": [{"exact": {"type": "created"}}]},
               {"cluster": "b", "filter": {"attributes": {"type": "shipped"}}},
               {"cluster": "c"},
               {"cluster": "d", "filters": []}
             ]},
             {"name": "plain", "hosts": ["plain"], "subscribers": [{"cluster": "e"}]}
           ]}"#,
    )
    .unwrap();
    let orders = &config.channels[0];
    assert!(orders.filtered);
    assert!(!config.channels[1].filtered);
    let created = Attributes::from([("type", "created")]);
    let accepts: Vec<bool> = orders
        .subscribers
        .iter()
        .map(|s| s.accepts(Some(&created)))
        .collect();
    assert_eq!(accepts, [true, false, true, true]);
    let not_an_event: Vec<bool> = orders.subscribers.iter().map(|s| s.accepts(None)).collect();
    assert_eq!(not_an_event, [false, false, true, true]);
}

/// The example of docs/configuration.md's "Subscription filters", as printed there.
#[test]
fn readme_filter_example_is_accepted_and_means_what_it_says() {
    let readme = include_str!("../../docs/configuration.md");
    let section = &readme[readme.find("## Subscription filters").unwrap()..];
    let start = section.find("```json\n").unwrap() + "```json\n".len();
    let example = &section[start..start + section[start..].find("```").unwrap()];
    let config = parse(example).unwrap();
    let channel = &config.channels[0];
    assert!(channel.filtered);
    let event = Attributes::from([
        ("type", "com.example.order.created"),
        ("source", "/orders/eu"),
        ("subject", "invoice.pdf"),
    ]);
    let wanted: Vec<&str> = channel
        .subscribers
        .iter()
        .filter(|s| s.accepts(Some(&event)))
        .map(|s| s.cluster.as_str())
        .collect();
    assert_eq!(
        wanted,
        ["billing", "archive", "shipping", "legacy", "audit"]
    );
    let mut test = event.clone();
    test.insert("env".into(), "test".into());
    test.insert("type".into(), "com.example.order.cancelled".into());
    let wanted: Vec<&str> = channel
        .subscribers
        .iter()
        .filter(|s| s.accepts(Some(&test)))
        .map(|s| s.cluster.as_str())
        .collect();
    assert_eq!(wanted, ["shipping", "audit"]);
}

#[test]
fn filter_rejections_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"channels": [{"subscribers": [{"cluster": "a"}, {"cluster": "b", "filters": [
                 {"exact": {"type": "t"}}, {"prefix": {"source": "/"}},
                 {"exact": {"type": "t", "source": "s"}}]}]}]}"#,
            "channels[0].subscribers[1].filters[2].exact: must name exactly one attribute",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "filters": [{"regex": {"type": "."}}]}]}"#,
            "subscribers[0].filters[0].regex: unknown operator \"regex\"",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "filters": [{"exact": {"": "t"}}]}]}"#,
            "subscribers[0].filters[0].exact.: the attribute name must not be empty",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "filters": {"exact": {"type": "t"}}}]}"#,
            "subscribers[0].filters: invalid type: map, expected a sequence",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "filter": {"attributes": {"": "t"}}}]}"#,
            "subscribers[0].filter.attributes.: the attribute name must not be empty",
        ),
        (
            r#"{"subscribers": [{"cluster": "a", "filter": {"attributes": {}}, "filters": []}]}"#,
            "subscribers[0].filter: cannot be used together with `filters`",
        ),
    ];
    for (json, expected) in cases {
        let message = error(json);
        assert!(
            message.starts_with(expected),
            "config {json:?}\n  gave: {message}\n  want: {expected}..."
        );
    }
}

#[test]
fn dedupe_is_off_unless_present_and_has_defaults() {
    assert_eq!(parse(r#"{"subscribers": []}"#).unwrap().dedupe, None);
    let config = parse(r#"{"dedupe": {}, "subscribers": []}"#).unwrap();
    assert_eq!(
        config.dedupe,
        Some(DedupeConfig {
            key: Identity::CloudEvent,
            ttl_ms: 600_000,
            max_entries: 100_000,
            store: Store::Envoy,
            on_store_error: OnStoreError::Deliver,
        })
    );
    let config = parse(
        r#"{"dedupe": {"key": "X-Event-Id", "ttl_ms": 1, "max_entries": 1}, "subscribers": []}"#,
    )
    .unwrap();
    let dedupe = config.dedupe.unwrap();
    assert_eq!(dedupe.key, Identity::Header("x-event-id".into()));
    assert_eq!((dedupe.ttl_ms, dedupe.max_entries), (1, 1));
    let config = parse(
        r#"{"dedupe": {"store": {"etcd": {"cluster": "etcd"}}, "on_store_error": "reject"},
            "subscribers": []}"#,
    )
    .unwrap();
    let dedupe = config.dedupe.unwrap();
    assert_eq!(
        dedupe.store,
        Store::Etcd(EtcdStore {
            cluster: "etcd".into(),
            prefix: "/fanout/".into(),
            timeout_ms: 250,
        })
    );
    assert_eq!(dedupe.on_store_error, OnStoreError::Reject);
    let config = parse(r#"{"dedupe": {"store": "envoy"}, "subscribers": []}"#).unwrap();
    assert_eq!(config.dedupe.unwrap().store, Store::Envoy);
    // One claim per event, whatever its subscribers: no bound from etcd's txn size.
    let many: Vec<String> = (0..500)
        .map(|i| format!(r#"{{"cluster": "s{i}"}}"#))
        .collect();
    let doc = format!(
        r#"{{"dedupe": {{"store": {{"etcd": {{"cluster": "etcd"}}}}}}, "subscribers": [{}]}}"#,
        many.join(",")
    );
    assert_eq!(parse(&doc).unwrap().channels[0].subscribers.len(), 500);
}

#[test]
fn dedupe_rejections_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (r#"{"key": ""}"#, "dedupe.key: \"\" is not a header name"),
        (
            r#"{"key": "ce id"}"#,
            "dedupe.key: \"ce id\" is not a header name",
        ),
        (r#"{"key": ":path"}"#, "dedupe.key:"),
        (r#"{"ttl_ms": 0}"#, "dedupe.ttl_ms: must be from 1 to"),
        (
            r#"{"ttl_ms": 604800001}"#,
            "dedupe.ttl_ms: must be from 1 to",
        ),
        (
            r#"{"max_entries": 0}"#,
            "dedupe.max_entries: must be from 1 to 1000000",
        ),
        (
            r#"{"max_entries": 1000001}"#,
            "dedupe.max_entries: must be from 1",
        ),
        (
            r#"{"max_entries": -1}"#,
            "dedupe.max_entries: invalid value",
        ),
        (r#"{"ttl": 5}"#, "dedupe.ttl: unknown field `ttl`"),
        (
            r#"{"store": "redis"}"#,
            "dedupe.store: unknown variant `redis`, expected `envoy` or `etcd`",
        ),
        (
            r#"{"store": {"etcd": {}}}"#,
            "dedupe.store.etcd.cluster: required",
        ),
        (
            r#"{"store": {"etcd": {"cluster": "etcd", "prefix": "fanout/"}}}"#,
            "dedupe.store.etcd.prefix: must start with \"/\"",
        ),
        (
            r#"{"store": {"etcd": {"cluster": "etcd", "timeout_ms": 0}}}"#,
            "dedupe.store.etcd.timeout_ms: must be at least 1",
        ),
        (
            r#"{"store": {"etcd": {"cluster": "etcd", "timeout": 5}}}"#,
            "dedupe.store.etcd.timeout: unknown field `timeout`",
        ),
        (
            r#"{"on_store_error": "drop"}"#,
            "dedupe.on_store_error: unknown variant `drop`, expected `deliver` or `reject`",
        ),
    ];
    for (dedupe, expected) in cases {
        let message = error(&format!(r#"{{"dedupe": {dedupe}, "subscribers": []}}"#));
        assert!(
            message.contains(expected),
            "{dedupe}\n  gave: {message}\n  want: {expected}"
        );
    }
}

#[test]
fn several_methods_make_the_allow_header_with_options() {
    let config = parse(r#"{"methods": ["POST", "PUT"], "subscribers": []}"#).unwrap();
    assert_eq!(config.allow, "POST, PUT, OPTIONS");
}

#[test]
fn options_is_not_a_method_to_fan_out() {
    let message = error(r#"{"methods": ["POST", "OPTIONS"], "subscribers": []}"#);
    assert!(
        message.starts_with("methods[1]: OPTIONS is answered by fanout itself"),
        "{message}"
    );
}

#[test]
fn require_cloudevents_is_off_by_default_and_must_be_a_boolean() {
    assert!(!parse(r#"{"subscribers": []}"#).unwrap().require_cloudevents);
    let on = parse(r#"{"require_cloudevents": true, "subscribers": []}"#).unwrap();
    assert!(on.require_cloudevents);
    let message = error(r#"{"require_cloudevents": "yes", "subscribers": []}"#);
    assert!(
        message
            .starts_with("require_cloudevents: invalid type: string \"yes\", expected a boolean"),
        "{message}"
    );
}
