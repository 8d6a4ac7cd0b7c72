//! `delivery.format`: each subscriber gets the event in its content mode, converted once per
//! request; a request that cannot be converted is refused before anyone is called.

use super::*;

/// One subscriber as the event comes, one binary, one structured (Knative's word, `json`).
const FORMATS: &str = r#"{
  "forward_headers": ["content-type", "x-request-id", "ce-*"],
  "subscribers": [
    {"cluster": "as-is"},
    {"cluster": "bin", "delivery": {"format": "binary"}},
    {"cluster": "structured", "delivery": {"format": "json"}}
  ]
}"#;

const BINARY_EVENT: &[(&str, &str)] = &[
    (":method", "POST"),
    (":authority", "orders.default"),
    (":path", "/"),
    ("x-request-id", "r-1"),
    ("ce-specversion", "1.0"),
    ("ce-id", "e-1"),
    ("ce-source", "/orders"),
    ("ce-type", "com.example.created"),
    ("ce-greeting", "gr%C3%BC%C3%9Fe"),
    ("content-type", "application/json"),
];

const STRUCTURED_BODY: &str = r#"{"specversion":"1.0","id":"e-1","source":"/orders","type":"com.example.created","greeting":"grüße","datacontenttype":"application/json","data":{"order":7}}"#;

fn structured_event() -> Vec<(&'static str, &'static str)> {
    let mut headers = post("orders.default");
    headers.extend([
        ("x-request-id", "r-1"),
        ("content-type", "application/cloudevents+json"),
    ]);
    headers
}

/// Every call's forwarded headers (the request line left out) and body, by cluster.
/// One call: its cluster, forwarded headers and body.
type SentCall = (String, Vec<(String, String)>, String);

fn calls(plugin: &FakeEnvoy) -> Vec<SentCall> {
    plugin
        .state()
        .dispatched
        .iter()
        .map(|call| {
            let headers = call
                .headers
                .iter()
                .filter(|(n, _)| !n.starts_with(':'))
                .map(|(n, v)| (n.clone(), String::from_utf8(v.clone()).unwrap()))
                .collect();
            let body = String::from_utf8(call.body.clone()).unwrap();
            (call.cluster.clone(), headers, body)
        })
        .collect()
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

fn answer_all(plugin: &FakeEnvoy, ctx: &mut Stream<FakeHost>) {
    for cluster in ["as-is", "bin", "structured"] {
        plugin.answer(ctx, cluster, Some(200), "");
    }
}

#[test]
fn a_binary_event_goes_structured_only_to_the_subscriber_that_asks() {
    let plugin = FakeEnvoy::configured(FORMATS);
    let mut ctx = send(&plugin, BINARY_EVENT, br#"{"order":7}"#);
    let as_came = owned(&BINARY_EVENT[3..]);
    let got = calls(&plugin);
    assert_eq!(got.len(), 3);
    assert_eq!(
        got[0],
        ("as-is".into(), as_came.clone(), r#"{"order":7}"#.into())
    );
    assert_eq!(got[1], ("bin".into(), as_came, r#"{"order":7}"#.into()));
    assert_eq!(
        got[2],
        (
            "structured".into(),
            owned(&[
                ("x-request-id", "r-1"),
                ("content-type", "application/cloudevents+json")
            ]),
            STRUCTURED_BODY.into()
        )
    );
    answer_all(&plugin, &mut ctx);
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn a_structured_event_goes_binary_only_to_the_subscriber_that_asks() {
    let plugin = FakeEnvoy::configured(FORMATS);
    let mut ctx = send(&plugin, &structured_event(), STRUCTURED_BODY.as_bytes());
    let got = calls(&plugin);
    let as_came = owned(&structured_event()[3..]);
    assert_eq!(
        got[0],
        ("as-is".into(), as_came.clone(), STRUCTURED_BODY.into())
    );
    assert_eq!(
        got[2],
        ("structured".into(), as_came, STRUCTURED_BODY.into())
    );
    assert_eq!(
        got[1],
        (
            "bin".into(),
            owned(&[
                ("x-request-id", "r-1"),
                ("ce-specversion", "1.0"),
                ("ce-id", "e-1"),
                ("ce-source", "/orders"),
                ("ce-type", "com.example.created"),
                ("ce-greeting", "gr%C3%BC%C3%9Fe"),
                ("content-type", "application/json"),
            ]),
            r#"{"order":7}"#.into()
        )
    );
    answer_all(&plugin, &mut ctx);
    assert_eq!(plugin.only_answer(), Answer::accepted());
}

#[test]
fn a_request_that_cannot_be_converted_gets_400_before_any_call_or_claim() {
    let config = FORMATS.replacen('{', r#"{"dedupe": {"key": "x-request-id"}, "#, 1);
    let plugin = FakeEnvoy::configured(&config);
    let shared_calls = |plugin: &FakeEnvoy| {
        let state = plugin.state();
        let shared = state.shared.borrow();
        shared.gets + shared.sets
    };
    let before = shared_calls(&plugin);
    let mut not_an_event = post("orders.default");
    not_an_event.extend([("x-request-id", "r-1"), ("content-type", "text/plain")]);
    let mut not_utf8 = BINARY_EVENT.to_vec();
    not_utf8.push(("ce-broken", "%FF"));
    let mut batch = post("orders.default");
    batch.push(("content-type", "application/cloudevents-batch+json"));
    type FormatCase<'a> = (&'a [(&'a str, &'a str)], &'a [u8], &'a str);
    let cases: [FormatCase; 4] = [
        (&not_an_event, b"hello", "subscriber bin (#1) takes events in binary mode (delivery.format), and this request cannot be converted: not a CloudEvent"),
        (&not_utf8, b"{}", "header ce-broken is not UTF-8 once percent-decoded"),
        (&batch, b"[]", "a batch of CloudEvents"),
        (&structured_event(), br#"{"specversion":"1.0","id":"1","source":"/s","type":"t","ext":1.5}"#, "subscriber bin (#1) takes events in binary mode (delivery.format), and this request cannot be converted: member ext is 1.5, not an integer"),
    ];
    for (i, (headers, body, error)) in cases.into_iter().enumerate() {
        let _ctx = send(&plugin, headers, body);
        let answers = plugin.answers();
        let answer = answers.last().unwrap();
        assert_eq!(answer.status, 400, "{headers:?}");
        let message = report(answer)["error"].as_str().unwrap().to_string();
        assert!(message.contains(error), "{message}");
        assert_eq!(answers.len(), i + 1);
    }
    assert!(plugin.state().dispatched.is_empty(), "somebody was called");
    assert_eq!(shared_calls(&plugin), before, "a dedupe claim was taken");
    let mut plugin = plugin;
    assert_eq!(plugin.flushed("fanout.requests.rejected.400"), 4);
}

#[test]
fn a_subscriber_whose_format_is_the_events_costs_no_host_call() {
    let run = |config: &str| {
        let plugin = FakeEnvoy::configured(config);
        let before = plugin.state().calls.clone();
        let mut ctx = send(&plugin, BINARY_EVENT, br#"{"order":7}"#);
        for token in 1..=2 {
            plugin.answer_call(&mut ctx, token, Some(200), "");
        }
        assert_eq!(plugin.only_answer(), Answer::accepted());
        let after = plugin.state().calls.clone();
        let calls: Vec<_> = after
            .iter()
            .map(|(name, n)| (*name, n - before.get(name).copied().unwrap_or(0)))
            .collect();
        let sent = plugin.state().dispatched.clone();
        (calls, sent)
    };
    let plain = r#"{"metrics": false, "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#;
    let same = r#"{"metrics": false, "subscribers": [{"cluster": "a"},
                   {"cluster": "b", "delivery": {"format": "binary"}}]}"#;
    let converting = r#"{"metrics": false, "subscribers": [{"cluster": "a"},
                   {"cluster": "b", "delivery": {"format": "structured"}}]}"#;
    let (plain_calls, plain_sent) = run(plain);
    let (same_calls, same_sent) = run(same);
    let (converting_calls, converting_sent) = run(converting);
    assert_eq!(same_calls, plain_calls);
    assert_eq!(same_sent, plain_sent);
    // Converting is work inside the VM, not host calls; only the body differs.
    assert_eq!(converting_calls, plain_calls);
    assert_ne!(converting_sent[1].body, plain_sent[1].body);
}

#[test]
fn retries_and_the_dead_letter_carry_the_converted_event() {
    let config = r#"{
      "forward_headers": ["content-type", "ce-*"],
      "subscribers": [{"cluster": "structured", "delivery": {"format": "json", "retry": 1,
        "backoff_delay_ms": 10, "dead_letter": {"cluster": "dlq"}}}]
    }"#;
    let mut plugin = FakeEnvoy::configured(config);
    let mut ctx = send(&plugin, BINARY_EVENT, br#"{"order":7}"#);
    plugin.answer(&mut ctx, "structured", Some(500), "no");
    plugin.tick_at(1_000);
    let retry = plugin.last_call();
    assert_eq!(retry.cluster, "structured");
    let first = plugin.state().dispatched[0].clone();
    assert_eq!(retry.body, first.body);
    assert_eq!(
        retry.body,
        STRUCTURED_BODY.replace(",\"x-request-id\"", "").as_bytes()
    );
    plugin.answer_root_call(retry.token, Some(500), "still no", &[]);
    plugin.tick_at(2_000);
    let letter = plugin.last_call();
    assert_eq!(letter.cluster, "dlq");
    assert_eq!(
        header_of(&letter, "content-type").as_deref(),
        Some("application/cloudevents+json")
    );
    assert_eq!(header_of(&letter, "ce-id"), None);
    // Structured: Knative's error attributes are members of the converted event.
    let body: Value = serde_json::from_slice(&letter.body).unwrap();
    assert_eq!(body["id"], "e-1");
    assert_eq!(body["greeting"], "grüße");
    assert_eq!(body["data"], serde_json::json!({"order": 7}));
    assert_eq!(body["knativeerrorcode"], 500);
}
