//! Knative's own table-driven tests of its channel data plane, replayed against fanout in the
//! real Envoy: knative/eventing `pkg/channel/fanout/fanout_event_handler_test.go` (the fan-out
//! handler), `pkg/kncloudevents/event_dispatcher_test.go` (one delivery: destination, reply,
//! dead-letter sink) and `pkg/kncloudevents/retries_test.go` (which answers are retried, the
//! backoff, `Retry-After`).
//!
//! Each case is data: Knative's case name, the subscribers' behaviour, the reply and
//! dead-letter targets, the retry settings, what Knative's test expects, and the verdict:
//! - [`Verdict::Agrees`]: the test asserts Knative's expectation of fanout;
//! - [`Verdict::Differs`]: fanout does otherwise by design; the case says why and where that is
//!   documented, and the test asserts fanout's documented behaviour, and that it still differs
//!   (a difference that went away must leave the table);
//! - cases that cannot be said over HTTP (Go hooks and setters, a status that is no
//!   status on the wire) are in [`NOT_REPLAYED`] with the reason.
//!
//! How Knative's Go values become HTTP: its handler's `202` or error is fanout's `202` or
//! `500` (sync mode); a dispatcher's error is a `500` (no dead letter) and a dead-lettered
//! event its `202` with `x-fanout-dead-lettered`; the delivery settings are what
//! `fanout-control render` writes for Knative's `DeliverySpec`; backoff durations are scaled
//! down and only their counts, order and lower bounds are asserted (with
//! [`harness::timing`]'s slack; upper bounds only where the wrong value is seconds away).
//! `docs/knative.md` "Knative's dispatcher tests, replayed" is the table of all of it; the test
//! `every_case_is_in_the_docs_table` keeps the two together.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::harness;

mod event_formats;
mod handler;
mod retries;
mod send_event;

// What the tables share: the event, the verdict's check, the import.
use event_formats::{full_event_in, Encoding, FormatData, FORMAT_CASES};
use handler::{assert_verdict_is_honest, HANDLER_CASES};
use retries::{import_deliveries, RETRY_AFTER_CASES, SELECTIVE_CASES, SPEC_CASES};
use send_event::dispatch_cases;

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::{Duration, Instant, SystemTime};

use base64::Engine;
use harness::faults::{Fault, FaultServer};
use harness::sdk::b64;
use harness::timing::{assert_waited_about, assert_waited_at_least};
use harness::{send, Behavior, Client, Envoy, EnvoyBuilder, Recorded, Subscriber, TempDir};
use serde_json::{json, Value};

/// Whether fanout does what Knative's case expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Agrees,
    /// Why fanout does otherwise, and where that is documented.
    Differs(&'static str),
}

/// A Knative case this suite does not replay, and why.
struct NotReplayed {
    file: &'static str,
    case: &'static str,
    why: &'static str,
}

const HANDLER_TEST: &str = "fanout_event_handler_test.go";
const DISPATCHER_TEST: &str = "event_dispatcher_test.go";
const RETRIES_TEST: &str = "retries_test.go";

/// The cases that are not replayed over HTTP, with the reason (also in docs/knative.md).
const NOT_REPLAYED: &[NotReplayed] = &[
    NotReplayed {
        file: HANDLER_TEST,
        case: "TestSubscriberSpecToFanoutConfig",
        why: "a Go conversion of Knative's SubscriberSpec; fanout's is the control plane's Knative mapping, \
              tested in tests/e2e/knative_import.rs",
    },
    NotReplayed {
        file: HANDLER_TEST,
        case: "TestGetSetSubscriptions",
        why: "a Go setter; fanout's subscriptions change by reloading its configuration \
              (tests/e2e/reload.rs)",
    },
    NotReplayed {
        file: HANDLER_TEST,
        case: "rejected by receiver",
        why: "a Go EventReceiverFunc hook that fails the request; fanout runs no code of the \
              user's before fanning out",
    },
    NotReplayed {
        file: HANDLER_TEST,
        case: "receiver has span",
        why: "an OpenTelemetry span in the Go context; fanout starts no spans (it passes the \
              sender's trace context on; Envoy's tracing is the place for spans)",
    },
    NotReplayed {
        file: DISPATCHER_TEST,
        case: "TestDispatchMessageToTLSEndpoint",
        why: "TLS to a destination is Envoy's upstream TLS, not fanout's; an https subscriber \
              is tested in tests/e2e/knative_import.rs; the plain-HTTP part of the two TLS \
              cases below is replayed",
    },
    NotReplayed {
        file: RETRIES_TEST,
        case: "Http StatusCode -1",
        why: "no status on the wire: an HTTP answer's status has three digits",
    },
    NotReplayed {
        file: RETRIES_TEST,
        case: "Http StatusCode 100",
        why: "a 1xx is an interim answer over HTTP, never the final one: Envoy waits for the \
              final answer (src/retry.rs retry_decision_table has 1xx as a failure not retried)",
    },
    NotReplayed {
        file: RETRIES_TEST,
        case: "Http StatusCode 102",
        why: "as for 100",
    },
];

// ---------------------------------------------------------------------------------------
// Helpers

/// This builder with the connection manager as every shipped bootstrap has it:
/// `generate_request_id: false`, so that a sender without `x-request-id` gets none made up
/// (docs/security.md), as Knative forwards only what the sender sent.
fn as_shipped(builder: EnvoyBuilder) -> EnvoyBuilder {
    let mut resources = builder.bootstrap()["static_resources"].clone();
    resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["generate_request_id"] = json!(false);
    builder.bootstrap_field("static_resources", resources)
}

/// POST these headers and body to `host` (the channel's host).
fn post(envoy: &Envoy, host: &str, headers: &[(String, String)], body: &str) -> harness::Reply {
    let mut request = Client::http1().post(&envoy.url("/")).header("host", host);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    send(request.body(body.to_owned()))
}

/// How long the suite waits, once every case's request was answered, for requests that must
/// not come (a fixed wait: a loaded machine can only make it miss one, never fail).
const SETTLE: Duration = Duration::from_millis(300);

/// Asserts that `sub` got `n` requests: waits (bounded) for them, and counts no more, after
/// [`SETTLE`] has passed since the cases' requests.
fn has_exactly(sub: &Subscriber, n: usize, what: &str) {
    sub.wait_for(n, Duration::from_secs(15));
    assert_eq!(
        sub.count(),
        n,
        "{what}: {}: {:#?}",
        sub.name(),
        sub.requests()
    );
}

#[test]
fn every_case_is_in_the_docs_table() {
    let doc = harness::read_shipped("docs/knative.md");
    let section = doc
        .split("## Knative's dispatcher tests, replayed")
        .nth(1)
        .expect("docs/knative.md has the section \"Knative's dispatcher tests, replayed\"");
    let dispatch = dispatch_cases();
    let word = |verdict: Verdict| match verdict {
        Verdict::Agrees => "agrees",
        Verdict::Differs(_) => "differs",
    };
    // Not replayed: the row must say so, and why (this reason, in other words if need be).
    let mut rows: Vec<(&str, &str, &str)> = NOT_REPLAYED
        .iter()
        .map(|c| (c.file, c.case, "not replayed"))
        .collect();
    for case in NOT_REPLAYED {
        let row = format!("| {} | {} | not replayed: ", case.file, case.case);
        assert!(
            section.lines().any(|l| l.starts_with(&row)),
            "docs/knative.md: no row starting {row:?} saying why ({})",
            case.why
        );
    }
    rows.extend(
        HANDLER_CASES
            .iter()
            .map(|c| (HANDLER_TEST, c.knative, word(c.verdict))),
    );
    rows.extend(
        dispatch
            .iter()
            .map(|c| (DISPATCHER_TEST, c.knative.as_str(), word(c.verdict()))),
    );
    rows.extend(
        SELECTIVE_CASES
            .iter()
            .map(|c| (RETRIES_TEST, c.knative, "agrees")),
    );
    rows.extend(
        SPEC_CASES
            .iter()
            .map(|c| (RETRIES_TEST, c.knative, word(c.verdict))),
    );
    rows.extend(
        RETRY_AFTER_CASES
            .iter()
            .map(|c| (RETRIES_TEST, c.knative, word(c.verdict))),
    );
    rows.extend(
        FORMAT_CASES
            .iter()
            .map(|c| (DISPATCHER_TEST, c.knative, word(c.verdict))),
    );
    rows.push((RETRIES_TEST, "TestNoRetries", "agrees"));
    rows.push((DISPATCHER_TEST, "reply - only", "agrees"));
    for (file, case, verdict) in rows {
        let row = format!("| {file} | {case} | {verdict}");
        assert!(
            section.lines().any(|l| l.starts_with(&row)),
            "docs/knative.md's replay table has no row starting {row:?}"
        );
    }
}
