//! Knative's `retries_test.go`: which answers are retried, the backoff, `Retry-After`,
//! replayed.

use super::*;

/// How a retry case's subscriber answers its first attempt.
#[derive(Clone, Copy, Debug)]
enum FirstAnswer {
    Status(u16),
    /// No answer: the connection is reset (Knative's nil response).
    Reset,
    /// An answer cut short: the 200's headers, then the connection closes (Knative's 200
    /// with an error).
    CutShort,
}

pub(super) struct SelectiveCase {
    pub(super) knative: &'static str,
    first: FirstAnswer,
    /// Knative's `result`: retried.
    retried: bool,
}

pub(super) const SELECTIVE_CASES: &[SelectiveCase] = &[
    SelectiveCase {
        knative: "Nil Response",
        first: FirstAnswer::Reset,
        retried: true,
    },
    SelectiveCase {
        knative: "Http Error",
        first: FirstAnswer::CutShort,
        retried: true,
    },
    SelectiveCase {
        knative: "Http StatusCode 200",
        first: FirstAnswer::Status(200),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 201",
        first: FirstAnswer::Status(201),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 202",
        first: FirstAnswer::Status(202),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 300",
        first: FirstAnswer::Status(300),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 301",
        first: FirstAnswer::Status(301),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 400",
        first: FirstAnswer::Status(400),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 401",
        first: FirstAnswer::Status(401),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 403",
        first: FirstAnswer::Status(403),
        retried: false,
    },
    SelectiveCase {
        knative: "Http StatusCode 404",
        first: FirstAnswer::Status(404),
        retried: true,
    },
    SelectiveCase {
        knative: "Http StatusCode 408",
        first: FirstAnswer::Status(408),
        retried: true,
    },
    SelectiveCase {
        knative: "Http StatusCode 409",
        first: FirstAnswer::Status(409),
        retried: true,
    },
    SelectiveCase {
        knative: "Http StatusCode 429",
        first: FirstAnswer::Status(429),
        retried: true,
    },
    SelectiveCase {
        knative: "Http StatusCode 500",
        first: FirstAnswer::Status(500),
        retried: true,
    },
    SelectiveCase {
        knative: "Http StatusCode 501",
        first: FirstAnswer::Status(501),
        retried: true,
    },
];

/// A subscriber that counts its attempts: a harness subscriber or, for an answer cut short,
/// a fault server.
enum Counting {
    Subscriber(Subscriber),
    Fault(FaultServer),
}

impl Counting {
    fn port(&self) -> u16 {
        match self {
            Counting::Subscriber(s) => s.port(),
            Counting::Fault(f) => f.port(),
        }
    }

    fn count(&self) -> usize {
        match self {
            Counting::Subscriber(s) => s.count(),
            Counting::Fault(f) => f.count(),
        }
    }
}

#[test]
fn retries_selective_retry_and_no_retries() {
    // One event to one subscriber per case, each allowed one retry: 2 attempts where Knative's
    // SelectiveRetry says retry, 1 where it does not. TestNoRetries: without a retry setting,
    // a 500 gets 1 attempt.
    let mut builder = Envoy::builder();
    let mut subscribers = Vec::new();
    let mut servers = Vec::new();
    for (i, case) in SELECTIVE_CASES.iter().enumerate() {
        let name = format!("r{i}");
        let server = match case.first {
            FirstAnswer::Status(status) => Counting::Subscriber(Subscriber::start(
                &name,
                Behavior::Sequence(vec![Behavior::Status(status), Behavior::Status(200)]),
            )),
            FirstAnswer::Reset => Counting::Subscriber(Subscriber::start(
                &name,
                Behavior::Sequence(vec![Behavior::Reset, Behavior::Status(200)]),
            )),
            FirstAnswer::CutShort => Counting::Fault(FaultServer::start(
                &name,
                Fault::Raw(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b".to_vec()),
            )),
        };
        builder = builder.cluster(&name, server.port());
        subscribers.push(json!({ "cluster": name,
                                 "delivery": { "retry": 1, "backoff_delay_ms": 10 } }));
        servers.push(server);
    }
    let no_retries = Subscriber::start("no-retries", Behavior::Status(500));
    builder = builder.cluster("no-retries", no_retries.port());
    subscribers.push(json!({ "cluster": "no-retries" }));
    let envoy = builder
        .fanout(&json!({ "subscribers": subscribers }))
        .start();
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    // Sync mode: the answer comes after every retry.
    assert_eq!(reply.status, 500, "{}", reply.text());
    for (case, server) in SELECTIVE_CASES.iter().zip(&servers) {
        assert_eq!(
            server.count(),
            if case.retried { 2 } else { 1 },
            "{}: retried is {}",
            case.knative,
            case.retried
        );
    }
    assert_eq!(no_retries.count(), 1, "TestNoRetries");
    // What is not a 2xx and not retried is a failure, 3xx included (Knative's isFailure).
    let failed: Vec<String> = reply.json()["failed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["cluster"].as_str().unwrap().to_owned())
        .collect();
    for (i, case) in SELECTIVE_CASES.iter().enumerate() {
        // A status not retried fails unless it is a 2xx; the answer cut short fails on its
        // retry too (the fault server always cuts it short); the rest succeed on their retry.
        let fails = match case.first {
            FirstAnswer::Status(status) => !(200..300).contains(&status) && !case.retried,
            FirstAnswer::CutShort => true,
            FirstAnswer::Reset => false,
        };
        assert_eq!(
            failed.contains(&format!("r{i}")),
            fails,
            "{}: {failed:?}",
            case.knative
        );
    }
}

/// `fanout-control render` on one InMemoryChannel whose subscribers have these `delivery`
/// specs: the exit code, stderr and, when it succeeded, each subscriber as fanout's config has
/// it.
pub(super) fn import_deliveries(deliveries: &[Value]) -> (i32, String, Vec<Value>) {
    let subscribers: Vec<Value> = deliveries
        .iter()
        .enumerate()
        .map(|(i, delivery)| {
            json!({ "subscriberUri": format!("http://s{i}.replay.svc.cluster.local/"),
                    "delivery": delivery })
        })
        .collect();
    let objects = json!({ "items": [{
        "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
        "metadata": { "name": "replay", "namespace": "knative" },
        "spec": { "subscribers": subscribers },
        "status": { "address": { "url": "http://replay-kn-channel.knative.svc.cluster.local" } }
    }] });
    let dir = TempDir::new("fanout-knative-replay", "the import's output");
    let out = dir.path().join("out");
    let (code, _, stderr) =
        harness::control::render_objects(dir.path(), &objects.to_string(), &out, &[]);
    if code != 0 {
        return (code, stderr, Vec::new());
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("out/fanout.json")).unwrap())
            .unwrap();
    let subscribers = config["channels"][0]["subscribers"]
        .as_array()
        .unwrap()
        .clone();
    (code, stderr, subscribers)
}

/// fanout's `delivery` and `timeout_ms` the import writes, or the field its error names.
type ImportResult = Result<(Value, Option<u64>), &'static str>;

/// A Knative DeliverySpec case of TestRetryConfigFromDeliverySpec and
/// TestRetryConfigFromDeliverySpecCheckRetry, and fanout's delivery the import writes for it.
pub(super) struct SpecCase {
    pub(super) knative: &'static str,
    spec: fn() -> Value,
    /// What the import writes; an error for Knative's `wantErr`.
    fanout: fn() -> ImportResult,
    pub(super) verdict: Verdict,
}

const LINEAR_WHY: &str = "fanout waits delay * n before retry n, Knative delay * (n-1): each \
     linear wait is one delay longer (docs/knative.md, the import's backoffPolicy row); \
     exponential waits are Knative's to the ms";

pub(super) const SPEC_CASES: &[SpecCase] = &[
    SpecCase {
        knative: "Successful Linear Backoff 2500ms, 5 retries",
        spec: || json!({ "retry": 5, "backoffPolicy": "linear", "backoffDelay": "PT2.5S" }),
        fanout: || {
            Ok((
                json!({ "retry": 5, "backoff_policy": "linear", "backoff_delay_ms": 2500,
                    "backoff_max_ms": 12500 }),
                None,
            ))
        },
        verdict: Verdict::Differs(LINEAR_WHY),
    },
    SpecCase {
        knative: "Successful Exponential Backoff 1500ms, 5 retries",
        spec: || json!({ "retry": 5, "backoffPolicy": "exponential", "backoffDelay": "PT1.5S" }),
        fanout: || {
            Ok((
                json!({ "retry": 5, "backoff_policy": "exponential", "backoff_delay_ms": 750,
                    "backoff_max_ms": 24000 }),
                None,
            ))
        },
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "Successful Exponential Backoff 500ms, 5 retries",
        spec: || json!({ "retry": 5, "backoffPolicy": "exponential", "backoffDelay": "PT0.5S" }),
        fanout: || {
            Ok((
                json!({ "retry": 5, "backoff_policy": "exponential", "backoff_delay_ms": 250,
                    "backoff_max_ms": 8000 }),
                None,
            ))
        },
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "Invalid Backoff Delay",
        spec: || json!({ "retry": 5, "backoffPolicy": "linear", "backoffDelay": "FOO" }),
        fanout: || Err("backoffDelay"),
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "Valid Timeout",
        spec: || {
            json!({ "retry": 5, "backoffPolicy": "exponential", "backoffDelay": "PT0.5S",
                          "timeout": "PT30S" })
        },
        fanout: || {
            Ok((
                json!({ "retry": 5, "backoff_policy": "exponential", "backoff_delay_ms": 250,
                    "backoff_max_ms": 8000 }),
                Some(30000),
            ))
        },
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "Invalid Timeout",
        spec: || {
            json!({ "retry": 5, "backoffPolicy": "exponential", "backoffDelay": "PT0.5S",
                          "timeout": "FOO" })
        },
        fanout: || Err("timeout"),
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "Valid RetryAfterMax",
        spec: || {
            json!({ "retry": 5, "backoffPolicy": "exponential", "backoffDelay": "PT0.5S",
                          "retryAfterMax": "PT30S" })
        },
        fanout: || {
            Ok((
                json!({ "retry": 5, "backoff_policy": "exponential", "backoff_delay_ms": 250,
                    "backoff_max_ms": 30000 }),
                None,
            ))
        },
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "Invalid RetryAfterMax",
        spec: || {
            json!({ "retry": 5, "backoffPolicy": "exponential", "backoffDelay": "PT0.5S",
                          "retryAfterMax": "FOO" })
        },
        fanout: || Err("retryAfterMax"),
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "full delivery",
        spec: || {
            json!({ "retry": 10, "backoffPolicy": "linear", "backoffDelay": "PT1S",
                          "timeout": "PT10S" })
        },
        fanout: || {
            Ok((
                json!({ "retry": 10, "backoff_policy": "linear", "backoff_delay_ms": 1000,
                    "backoff_max_ms": 10000 }),
                Some(10000),
            ))
        },
        verdict: Verdict::Differs(LINEAR_WHY),
    },
    SpecCase {
        knative: "only retry",
        spec: || json!({ "retry": 10, "backoffPolicy": "linear" }),
        fanout: || {
            Ok((
                json!({ "retry": 10, "backoff_delay_ms": 0, "backoff_max_ms": 0 }),
                None,
            ))
        },
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "delay not ISO8601",
        spec: || json!({ "retry": 10, "backoffPolicy": "linear", "backoffDelay": "PP1" }),
        fanout: || Err("backoffDelay"),
        verdict: Verdict::Agrees,
    },
    SpecCase {
        knative: "timeout not ISO8601",
        spec: || json!({ "retry": 10, "timeout": "PP1" }),
        fanout: || Err("timeout"),
        verdict: Verdict::Agrees,
    },
];

#[test]
fn retries_retry_config_from_delivery_spec_through_the_import() {
    // The valid specs in one import: each subscriber's delivery as fanout has it.
    let valid: Vec<&SpecCase> = SPEC_CASES.iter().filter(|c| (c.fanout)().is_ok()).collect();
    let (code, stderr, subscribers) =
        import_deliveries(&valid.iter().map(|c| (c.spec)()).collect::<Vec<_>>());
    assert_eq!(code, 0, "{stderr}");
    for (case, subscriber) in valid.iter().zip(&subscribers) {
        let Ok((delivery, timeout)) = &(case.fanout)() else {
            unreachable!()
        };
        assert_eq!(
            &subscriber["delivery"], delivery,
            "{}: {subscriber}",
            case.knative
        );
        assert_eq!(
            subscriber["timeout_ms"].as_u64(),
            *timeout,
            "{}",
            case.knative
        );
    }
    // The invalid ones in one import, which writes nothing and names each: Knative's wantErr
    // is the import's error naming the subscriber's field.
    let invalid: Vec<&SpecCase> = SPEC_CASES
        .iter()
        .filter(|c| (c.fanout)().is_err())
        .collect();
    let (code, stderr, _) =
        import_deliveries(&invalid.iter().map(|c| (c.spec)()).collect::<Vec<_>>());
    assert_eq!(code, 1, "{stderr}");
    let error_prefix = format!("{}: error: ", harness::control::RENDER_PREFIX);
    for (i, case) in invalid.iter().enumerate() {
        let Err(field) = (case.fanout)() else {
            unreachable!()
        };
        let named = format!("spec.subscribers[{i}].delivery.{field}: ");
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(&error_prefix) && l.contains(&named)),
            "{}: no error naming {named}: {stderr}",
            case.knative
        );
    }
}

#[test]
fn retries_backoff_schedules_in_envoy() {
    // Knative's backoff tables, scaled to PT0.1S, imported and run: a subscriber that always
    // fails gets retry + 1 attempts, in order, each gap at least its wait. Exponential: the
    // waits are Knative's, delay * 2^(n-1) before retry n. Linear: fanout waits delay * n,
    // one delay longer than Knative's delay * (n-1) (docs/knative.md, the import's table).
    // "only retry": no delay, 11 attempts.
    let specs = [
        json!({ "retry": 5, "backoffPolicy": "exponential", "backoffDelay": "PT0.1S" }),
        json!({ "retry": 5, "backoffPolicy": "linear", "backoffDelay": "PT0.1S" }),
        json!({ "retry": 10, "backoffPolicy": "linear" }),
    ];
    let waits_ms: [&[u64]; 3] = [
        &[100, 200, 400, 800, 1600],
        &[100, 200, 300, 400, 500],
        &[0; 10],
    ];
    let (code, stderr, imported) = import_deliveries(&specs);
    assert_eq!(code, 0, "{stderr}");
    let failing: Vec<Subscriber> = (0..specs.len())
        .map(|i| Subscriber::start(&format!("schedule{i}"), Behavior::Status(503)))
        .collect();
    let subscribers: Vec<Value> = imported
        .iter()
        .zip(&failing)
        .map(|(sub, server)| json!({ "cluster": server.name(), "delivery": sub["delivery"] }))
        .collect();
    let refs: Vec<&Subscriber> = failing.iter().collect();
    let envoy = Envoy::with_subscribers(&json!({ "subscribers": subscribers }), &refs);
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 500, "{}", reply.text());
    for ((server, waits), spec) in failing.iter().zip(waits_ms).zip(&specs) {
        let attempts = server.requests();
        assert_eq!(attempts.len(), waits.len() + 1, "{spec}: {attempts:#?}");
        for (n, wait) in waits.iter().enumerate() {
            let gap = attempts[n + 1].at - attempts[n].at;
            assert_waited_at_least(
                gap,
                Duration::from_millis(*wait),
                &format!("{spec}: before retry {}", n + 1),
            );
        }
    }
}

/// Knative's Retry-After formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RetryAfter {
    None,
    Seconds,
    Date,
    /// The date with the zone `UTC`, as Go's `time.RFC850` writes the local time on a machine
    /// in UTC: what Knative's test sends there.
    DateUtc,
    Invalid,
}

/// Knative's retryAfterMax in its cases: nil, the small (below the Retry-After) and the
/// large one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Max {
    Nil,
    Small,
    Large,
}

/// What Knative's case expects the wait to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    Backoff,
    RetryAfter,
    Max,
}

pub(super) struct RetryAfterCase {
    pub(super) knative: &'static str,
    max: Max,
    status: u16,
    format: RetryAfter,
    expected: Wait,
    pub(super) verdict: Verdict,
}

const fn ra(
    knative: &'static str,
    max: Max,
    status: u16,
    format: RetryAfter,
    expected: Wait,
) -> RetryAfterCase {
    RetryAfterCase {
        knative,
        max,
        status,
        format,
        expected,
        verdict: Verdict::Agrees,
    }
}

/// TestGenerateBackoffFnWithRetryAfter's table. Two of its "large max" and "small max" cases
/// have a nil max in Knative's data, and are replayed as written.
pub(super) const RETRY_AFTER_CASES: &[RetryAfterCase] = &[
    ra(
        "nil max 429 without Retry-After",
        Max::Nil,
        429,
        RetryAfter::None,
        Wait::Backoff,
    ),
    ra(
        "nil max 429 with Retry-After seconds",
        Max::Nil,
        429,
        RetryAfter::Seconds,
        Wait::Backoff,
    ),
    ra(
        "nil max 429 with Retry-After date",
        Max::Nil,
        429,
        RetryAfter::Date,
        Wait::Backoff,
    ),
    ra(
        "nil max 429 with invalid Retry-After",
        Max::Nil,
        429,
        RetryAfter::Invalid,
        Wait::Backoff,
    ),
    ra(
        "nil max 503 with Retry-After seconds",
        Max::Nil,
        503,
        RetryAfter::Seconds,
        Wait::Backoff,
    ),
    ra(
        "nil max 500 without Retry-After",
        Max::Nil,
        500,
        RetryAfter::None,
        Wait::Backoff,
    ),
    ra(
        "large max 429 without Retry-After",
        Max::Nil,
        429,
        RetryAfter::None,
        Wait::Backoff,
    ),
    ra(
        "large max 429 with Retry-After seconds",
        Max::Large,
        429,
        RetryAfter::Seconds,
        Wait::RetryAfter,
    ),
    ra(
        "large max 429 with Retry-After date",
        Max::Large,
        429,
        RetryAfter::Date,
        Wait::RetryAfter,
    ),
    ra(
        "large max 429 with invalid Retry-After",
        Max::Large,
        429,
        RetryAfter::Invalid,
        Wait::Backoff,
    ),
    ra(
        "large max 503 with Retry-After seconds",
        Max::Large,
        503,
        RetryAfter::Seconds,
        Wait::RetryAfter,
    ),
    ra(
        "large max 500 without Retry-After",
        Max::Large,
        500,
        RetryAfter::None,
        Wait::Backoff,
    ),
    ra(
        "small max 429 without Retry-After",
        Max::Nil,
        429,
        RetryAfter::None,
        Wait::Backoff,
    ),
    ra(
        "small max 429 with Retry-After seconds",
        Max::Small,
        429,
        RetryAfter::Seconds,
        Wait::Max,
    ),
    ra(
        "small max 429 with Retry-After date",
        Max::Small,
        429,
        RetryAfter::Date,
        Wait::Max,
    ),
    ra(
        "small max 429 with invalid Retry-After",
        Max::Small,
        429,
        RetryAfter::Invalid,
        Wait::Backoff,
    ),
    ra(
        "small max 503 with Retry-After seconds",
        Max::Small,
        503,
        RetryAfter::Seconds,
        Wait::Max,
    ),
    ra(
        "small max 500 without Retry-After",
        Max::Small,
        500,
        RetryAfter::None,
        Wait::Backoff,
    ),
    RetryAfterCase {
        knative: "large max 429 with Retry-After date, as written on a UTC machine",
        max: Max::Large,
        status: 429,
        format: RetryAfter::DateUtc,
        expected: Wait::Backoff,
        verdict: Verdict::Differs(UTC_DATE_WHY),
    },
];

const UTC_DATE_WHY: &str = "Knative's test formats the local time with Go's time.RFC850, whose \
     zone is the machine's (UTC on CI), and Go's http.ParseTime takes any zone name; an HTTP \
     date's zone is GMT (RFC 9110 5.6.7), and fanout (the httpdate crate) ignores another, \
     taking the backoff. With GMT, the case above, fanout agrees";

#[test]
fn retries_generate_backoff_fn_with_retry_after() {
    // Knative's 2 s backoff, 30 s Retry-After and 10 s / 90 s retryAfterMax, scaled and kept
    // in order: 200 ms (retry 1, exponential PT0.2S), 5 s, 2.5 s / 20 s. Imported as Knative
    // would have them, so a nil retryAfterMax caps Retry-After at the longest backoff.
    const BACKOFF: Duration = Duration::from_millis(200);
    const SMALL: Duration = Duration::from_millis(2500);
    const RETRY_AFTER: Duration = Duration::from_secs(5);
    let spec = |max: Max| {
        let mut spec =
            json!({ "retry": 1, "backoffPolicy": "exponential", "backoffDelay": "PT0.2S" });
        match max {
            Max::Nil => {}
            Max::Small => spec["retryAfterMax"] = json!("PT2.5S"),
            Max::Large => spec["retryAfterMax"] = json!("PT20S"),
        }
        spec
    };
    let (code, stderr, imported) = import_deliveries(
        &RETRY_AFTER_CASES
            .iter()
            .map(|c| spec(c.max))
            .collect::<Vec<_>>(),
    );
    assert_eq!(code, 0, "{stderr}");
    let servers: Vec<Subscriber> = (0..RETRY_AFTER_CASES.len())
        .map(|i| Subscriber::ok(&format!("ra{i}")))
        .collect();
    let subscribers: Vec<Value> = imported
        .iter()
        .zip(&servers)
        .map(|(sub, server)| json!({ "cluster": server.name(), "delivery": sub["delivery"] }))
        .collect();
    let refs: Vec<&Subscriber> = servers.iter().collect();
    let envoy = Envoy::with_subscribers(&json!({ "subscribers": subscribers }), &refs);
    // Six seconds from now, to the second, in the RFC 850 form Knative's test writes (with
    // the GMT zone HTTP dates have).
    let (wall, mono) = (SystemTime::now(), Instant::now());
    let date = rfc850(wall + Duration::from_secs(6));
    let at = httpdate::parse_http_date(&date).unwrap();
    for (case, server) in RETRY_AFTER_CASES.iter().zip(&servers) {
        let value = match case.format {
            RetryAfter::None => None,
            RetryAfter::Seconds => Some(RETRY_AFTER.as_secs().to_string()),
            RetryAfter::Date => Some(date.clone()),
            RetryAfter::DateUtc => Some(date.replace(" GMT", " UTC")),
            RetryAfter::Invalid => Some("FOO".to_owned()),
        };
        let headers: Vec<(&str, &str)> =
            value.iter().map(|v| ("retry-after", v.as_str())).collect();
        server.set_behavior(Behavior::Sequence(vec![
            Behavior::respond(case.status, &headers, ""),
            Behavior::Status(200),
        ]));
    }
    let reply = send(Client::http1().post(&envoy.url("/")).body("event"));
    assert_eq!(reply.status, 202, "{}", reply.text());
    for (case, server) in RETRY_AFTER_CASES.iter().zip(&servers) {
        let attempts = server.requests();
        assert_eq!(attempts.len(), 2, "{}: {attempts:#?}", case.knative);
        let gap = attempts[1].at - attempts[0].at;
        let what = case.knative;
        match case.expected {
            Wait::Backoff => {
                assert_waited_at_least(gap, BACKOFF, what);
                // The nearest wrong value is the small max, seconds away.
                assert!(
                    gap < SMALL,
                    "{what}: waited {gap:?}, not the {BACKOFF:?} backoff"
                );
            }
            Wait::Max => {
                assert_waited_at_least(gap, SMALL, what);
                assert!(
                    gap < RETRY_AFTER,
                    "{what}: waited {gap:?}, past the {SMALL:?} max"
                );
            }
            Wait::RetryAfter if case.format == RetryAfter::Date => {
                // Due at the date, whenever the first attempt arrived.
                let first = wall + (attempts[0].at - mono);
                let nominal = at.duration_since(first).unwrap();
                assert_waited_about(gap, nominal, what);
            }
            Wait::RetryAfter => assert_waited_about(gap, RETRY_AFTER, what),
        }
    }
}

/// An HTTP date in the obsolete RFC 850 form (`Wednesday, 02-Dec-26 02:10:00 GMT`), which a
/// recipient must accept (RFC 9110 5.6.7): Go's `time.RFC850`, as Knative's test writes it.
fn rfc850(at: SystemTime) -> String {
    // IMF-fixdate `Wed, 02 Dec 2026 02:10:00 GMT`, rearranged.
    let imf = httpdate::fmt_http_date(at);
    let parts: Vec<&str> = imf.split(' ').collect();
    let day = match parts[0].trim_end_matches(',') {
        "Mon" => "Monday",
        "Tue" => "Tuesday",
        "Wed" => "Wednesday",
        "Thu" => "Thursday",
        "Fri" => "Friday",
        "Sat" => "Saturday",
        _ => "Sunday",
    };
    format!(
        "{day}, {}-{}-{} {} GMT",
        parts[1],
        parts[2],
        &parts[3][2..],
        parts[4]
    )
}
