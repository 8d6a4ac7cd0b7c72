//! Knative's `fanout_event_handler_test.go`: TestFanoutEventHandler_ServeHTTP, replayed.

use super::*;

/// What one run of a handler case shows: the answer in sync and in async mode, and the
/// requests the subscriber server and the replier server got (Knative's `subscriberReqs`,
/// `replierReqs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HandlerOutcome {
    sync: u16,
    r#async: u16,
    subscriber_reqs: usize,
    replier_reqs: usize,
}

/// A [`HandlerOutcome`]: sync status, async status, subscriber requests, replier requests.
const fn outcome(
    sync: u16,
    r#async: u16,
    subscriber_reqs: usize,
    replier_reqs: usize,
) -> HandlerOutcome {
    HandlerOutcome {
        sync,
        r#async,
        subscriber_reqs,
        replier_reqs,
    }
}

pub(super) struct HandlerCase {
    /// Knative's case name.
    pub(super) knative: &'static str,
    /// How many subscriptions; each goes to the one subscriber server (and, with `reply`, to
    /// the one replier server), as in Knative's test.
    subscriptions: usize,
    reply: bool,
    subscriber: fn() -> Behavior,
    replier: fn() -> Behavior,
    /// Each call's `timeout_ms`.
    timeout_ms: Option<u32>,
    knative_expects: HandlerOutcome,
    fanout: HandlerOutcome,
    /// In sync mode, the failed leg and outcome fanout's 500 report names.
    failed: Option<(&'static str, &'static str)>,
    pub(super) verdict: Verdict,
}

/// Knative's `callableSucceed`: 200 with a binary event (`{}` as JSON).
fn callable_succeed() -> Behavior {
    Behavior::respond(
        200,
        &[
            ("ce-specversion", "1.0"),
            ("ce-type", "com.example.someotherevent"),
            ("ce-source", "/myothercontext"),
            ("ce-id", "B234-1234-1234"),
            ("content-type", "application/json"),
        ],
        "{}",
    )
}

/// Knative's "reply fails" subscriber: `test.FullEvent()` written as a binary answer with 202.
fn full_event_with(status: u16) -> Behavior {
    let (headers, body) = full_event_in(Encoding::Binary, FormatData::FullEvent);
    Behavior::Respond {
        status,
        headers,
        body,
    }
}

pub(super) const HANDLER_CASES: &[HandlerCase] = &[
    HandlerCase {
        knative: "fanout times out",
        subscriptions: 1,
        reply: false,
        subscriber: || Behavior::Delay(Duration::from_millis(1500), 202),
        replier: || Behavior::Status(200),
        // Knative's handler times the whole fan-out (1 ms in its test); fanout times each
        // call: with one subscriber, the same thing.
        timeout_ms: Some(300),
        knative_expects: outcome(500, 202, 1, 0),
        fanout: outcome(500, 202, 1, 0),
        failed: Some(("event", "timeout")),
        verdict: Verdict::Agrees,
    },
    HandlerCase {
        knative: "zero subs succeed",
        subscriptions: 0,
        reply: false,
        subscriber: || Behavior::Status(200),
        replier: || Behavior::Status(200),
        timeout_ms: None,
        knative_expects: outcome(202, 202, 0, 0),
        fanout: outcome(202, 202, 0, 0),
        failed: None,
        verdict: Verdict::Agrees,
    },
    HandlerCase {
        knative: "reply fails",
        subscriptions: 1,
        reply: true,
        subscriber: || full_event_with(202),
        replier: || Behavior::Status(404),
        timeout_ms: None,
        knative_expects: outcome(500, 202, 1, 1),
        fanout: outcome(202, 202, 1, 0),
        failed: None,
        verdict: Verdict::Differs(
            "the subscriber answers 202: a 202 is never a reply (knative/specs data-plane.md; \
             docs/knative.md, the 202 row); Knative's dispatcher takes any 2xx event",
        ),
    },
    HandlerCase {
        knative: "reply fails (answered 200)",
        subscriptions: 1,
        reply: true,
        subscriber: || full_event_with(200),
        replier: || Behavior::Status(404),
        timeout_ms: None,
        knative_expects: outcome(500, 202, 1, 1),
        fanout: outcome(500, 202, 1, 1),
        failed: Some(("reply", "status")),
        verdict: Verdict::Agrees,
    },
    HandlerCase {
        knative: "subscriber fails",
        subscriptions: 1,
        reply: false,
        subscriber: || Behavior::Status(404),
        replier: || Behavior::Status(200),
        timeout_ms: None,
        knative_expects: outcome(500, 202, 1, 0),
        fanout: outcome(500, 202, 1, 0),
        failed: Some(("event", "status")),
        verdict: Verdict::Agrees,
    },
    HandlerCase {
        knative: "subscriber succeeds, result fails",
        subscriptions: 1,
        reply: true,
        subscriber: callable_succeed,
        replier: || Behavior::Status(403),
        timeout_ms: None,
        knative_expects: outcome(500, 202, 1, 1),
        fanout: outcome(500, 202, 1, 1),
        failed: Some(("reply", "status")),
        verdict: Verdict::Agrees,
    },
    HandlerCase {
        knative: "one sub succeeds",
        subscriptions: 1,
        reply: true,
        subscriber: callable_succeed,
        replier: || Behavior::Status(202),
        timeout_ms: None,
        knative_expects: outcome(202, 202, 1, 1),
        fanout: outcome(202, 202, 1, 1),
        failed: None,
        verdict: Verdict::Agrees,
    },
    HandlerCase {
        knative: "one sub succeeds, one sub fails",
        subscriptions: 2,
        reply: true,
        subscriber: callable_succeed,
        // Knative's succeedOnce: 202 to the first request, 403 to the others.
        replier: || Behavior::Sequence(vec![Behavior::Status(202), Behavior::Status(403)]),
        timeout_ms: None,
        knative_expects: outcome(500, 202, 2, 2),
        fanout: outcome(500, 202, 2, 2),
        failed: Some(("reply", "status")),
        verdict: Verdict::Agrees,
    },
    HandlerCase {
        knative: "all subs succeed",
        subscriptions: 3,
        reply: true,
        subscriber: callable_succeed,
        replier: || Behavior::Status(202),
        timeout_ms: None,
        knative_expects: outcome(202, 202, 3, 3),
        fanout: outcome(202, 202, 3, 3),
        failed: None,
        verdict: Verdict::Agrees,
    },
];

/// Knative's `makeCloudEvent()`, as the binary-mode request its test sends.
fn handler_event() -> Vec<(String, String)> {
    [
        ("ce-specversion", "1.0"),
        ("ce-type", "com.example.someevent"),
        ("ce-source", "/mycontext"),
        ("ce-id", "A234-1234-1234"),
        ("ce-comexampleextension", "value"),
        ("content-type", "application/xml"),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), v.to_string()))
    .collect()
}

pub(super) fn assert_verdict_is_honest<T: PartialEq + std::fmt::Debug>(
    case: &str,
    verdict: Verdict,
    knative: &T,
    fanout: &T,
) {
    match verdict {
        Verdict::Agrees => assert_eq!(fanout, knative, "{case}: agrees, so fanout's is Knative's"),
        Verdict::Differs(_) => assert_ne!(
            fanout, knative,
            "{case}: listed as a difference, yet fanout's expectation is Knative's"
        ),
    }
}

/// One mode's run of every handler case: one Envoy, a channel per case (by host), a
/// subscriber server and a replier server per case.
fn replay_handler_cases(mode: &str) {
    struct Running {
        subscriber: Subscriber,
        replier: Subscriber,
        host: String,
    }
    let mut builder = Envoy::builder();
    let mut channels = Vec::new();
    let mut running = Vec::new();
    for (i, case) in HANDLER_CASES.iter().enumerate() {
        assert_verdict_is_honest(
            case.knative,
            case.verdict,
            &case.knative_expects,
            &case.fanout,
        );
        let subscriber = Subscriber::start(&format!("h{i}-subscriber"), (case.subscriber)());
        let replier = Subscriber::start(&format!("h{i}-replier"), (case.replier)());
        let reply_cluster = format!("h{i}-replier");
        builder = builder.cluster(&reply_cluster, replier.port());
        let mut subscribers = Vec::new();
        for k in 0..case.subscriptions {
            // One cluster per subscription, all to the one server, as Knative's test points
            // every subscription at one httptest server.
            let cluster = format!("h{i}-sub{k}");
            builder = builder.cluster(&cluster, subscriber.port());
            let mut sub = json!({ "cluster": cluster });
            if case.reply {
                sub["reply"] = json!({ "cluster": reply_cluster });
            }
            if let Some(ms) = case.timeout_ms {
                sub["timeout_ms"] = json!(ms);
            }
            subscribers.push(sub);
        }
        let host = format!("h{i}.replay");
        channels
            .push(json!({ "name": format!("h{i}"), "hosts": [host], "subscribers": subscribers }));
        running.push(Running {
            subscriber,
            replier,
            host,
        });
    }
    let envoy = builder
        .fanout(&json!({ "mode": mode, "channels": channels }))
        .start();
    for (case, run) in HANDLER_CASES.iter().zip(&running) {
        let what = format!("{mode} - {}", case.knative);
        let reply = post(&envoy, &run.host, &handler_event(), "<much wow=\"xml\"/>");
        let want = if mode == "sync" {
            case.fanout.sync
        } else {
            case.fanout.r#async
        };
        assert_eq!(reply.status, want, "{what}: {}", reply.text());
        if let (Some((leg, outcome)), "sync") = (case.failed, mode) {
            let failed = &reply.json()["failed"][0];
            assert_eq!(failed["leg"], leg, "{what}: {}", reply.text());
            assert_eq!(failed["outcome"], outcome, "{what}: {}", reply.text());
        }
    }
    std::thread::sleep(SETTLE);
    for (case, run) in HANDLER_CASES.iter().zip(&running) {
        let what = format!("{mode} - {}", case.knative);
        has_exactly(&run.subscriber, case.fanout.subscriber_reqs, &what);
        has_exactly(&run.replier, case.fanout.replier_reqs, &what);
    }
}

#[test]
fn fanout_event_handler_serve_http_sync() {
    replay_handler_cases("sync");
}

#[test]
fn fanout_event_handler_serve_http_async() {
    replay_handler_cases("async");
}
