//! Knative's `event_dispatcher_test.go`: TestSendEvent and the plain-HTTP part of its TLS
//! tests, replayed.

use super::*;

/// A header's expected value: any value (Knative's "ignored-value-header"), this one, or
/// none.
#[derive(Clone, Debug, PartialEq, Eq)]
enum V {
    Any,
    Is(String),
    Absent,
}

fn is(value: &str) -> V {
    V::Is(value.to_owned())
}

/// Which request of a case: to the destination, the reply target, the dead-letter sink.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Leg {
    Destination,
    Reply,
    DeadLetter,
}

const LEGS: [Leg; 3] = [Leg::Destination, Leg::Reply, Leg::DeadLetter];

/// An answer one of a case's servers gives (Knative's `fakeResponse`, ...).
#[derive(Clone, Copy)]
struct Answer {
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
}

impl Answer {
    fn behavior(&self) -> Behavior {
        Behavior::respond(self.status, self.headers, self.body)
    }
}

const fn answer(status: u16, body: &'static str) -> Answer {
    Answer {
        status,
        headers: &[],
        body,
    }
}

/// What a server must receive: headers and body. `exact`: the headers [`compared`] are
/// exactly these (Knative's `cmp.Diff`); otherwise only these are checked (Knative's TLS
/// tests check the event's id and data).
#[derive(Clone, Debug)]
struct Expected {
    headers: Vec<(&'static str, V)>,
    body: String,
    exact: bool,
}

/// A header where fanout sends otherwise than Knative's case expects, by design.
#[derive(Clone, Debug)]
struct Deviation {
    leg: Leg,
    header: &'static str,
    fanout: V,
    why: &'static str,
}

/// Where fanout sends otherwise at all: the legs it sends, its error, and why.
#[derive(Clone, Debug)]
struct Otherwise {
    legs: Vec<Leg>,
    error: bool,
    why: &'static str,
}

/// The event Knative's case sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sent {
    /// TestSendEvent's: `testtype` from `testsource`, extension `abc`, this data as JSON.
    TestEvent(&'static str),
    /// sdk-go's `test.FullEvent()` (the TLS tests').
    FullEvent,
}

#[derive(Clone)]
pub(super) struct DispatchCase {
    pub(super) knative: String,
    /// The sender's pass-through headers (Knative's `header`): `x-request-id: id123`,
    /// `knative-1`, `knative-2` and `do-not-forward`.
    sender_headers: bool,
    sent: Sent,
    destination: Answer,
    reply: Option<Answer>,
    dead_letter: Option<Answer>,
    /// Knative's `expectedErr`: fanout's 500.
    expected_err: bool,
    /// Knative's expected requests; a leg not listed gets none.
    expected: Vec<(Leg, Expected)>,
    /// Where Knative's `ce-knativeerrordest` points: the reply target or the destination.
    error_dest: Leg,
    deviations: Vec<Deviation>,
    otherwise: Option<Otherwise>,
}

impl DispatchCase {
    pub(super) fn verdict(&self) -> Verdict {
        match (&self.otherwise, self.deviations.first()) {
            (Some(o), _) => Verdict::Differs(o.why),
            (None, Some(d)) => Verdict::Differs(d.why),
            (None, None) => Verdict::Agrees,
        }
    }
}

/// The headers the replay compares, as Knative's test compares all but `content-type`,
/// `user-agent` and the like: the event's `ce-*`, the pass-through ones and those its cases
/// name. Envoy's own (`x-envoy-*`, `x-forwarded-proto`), `host`, `content-length`,
/// `content-type` and fanout's `x-fanout-*` are not.
fn compared(name: &str) -> bool {
    name.starts_with("ce-")
        || name.starts_with("knative-")
        || name.starts_with("do-not-")
        || matches!(name, "x-request-id" | "prefer" | "traceparent")
}

/// Suite-wide: Knative expects a `traceparent` on every request its dispatcher sends.
const TRACEPARENT_WHY: &str = "Knative's dispatcher starts a span per call and sends its \
     traceparent; fanout without `tracing` starts none and passes the sender's trace context \
     on (docs/knative.md, W3C trace context row), and these senders send none. With \
     `tracing` every call carries its own (event_dispatcher_send_event_traced)";

const PREFER_WHY: &str = "Prefer: reply goes only to a subscriber with a reply target, where \
     a reply is passed on (docs/knative.md, Prefer row); Knative sends it to every destination";

const A_202_WHY: &str = "the destination answers 202: a 202 is never a reply (knative/specs \
     data-plane.md; docs/knative.md, 202 row), so no reply and no reply's dead letter; \
     Knative's dispatcher takes an event from any 2xx. The same case answered 200 follows";

const REPLY_DEAD_LETTER_WHY: &str = "the dead letter of a failed reply carries the original \
     request's forwarded headers, not the answer's pass-through ones: one rule for every dead \
     letter (docs/delivery.md, Replies)";

const INVALID_REPLY_WHY: &str = "fanout takes a reply only when it is a valid CloudEvent \
     (ce-id, ce-source, ce-type too: docs/delivery.md, Replies); Knative's dispatcher forwards \
     any answer whose encoding its SDK reads (ce-specversion) without validating it, so its \
     reply target gets an event without source and type";

fn no_prefer() -> Deviation {
    Deviation {
        leg: Leg::Destination,
        header: "prefer",
        fanout: V::Absent,
        why: PREFER_WHY,
    }
}

fn headers(list: &[(&'static str, V)]) -> Vec<(&'static str, V)> {
    list.to_vec()
}

/// Knative's expected request to the destination, with or without the sender's
/// pass-through headers.
fn to_destination(sender_headers: bool) -> Expected {
    let mut list = Vec::new();
    if sender_headers {
        list.extend(headers(&[
            ("x-request-id", is("id123")),
            ("knative-1", is("knative-1-value")),
            ("knative-2", is("knative-2-value")),
        ]));
    }
    list.extend(headers(&[
        ("prefer", is("reply")),
        ("traceparent", V::Any),
        ("ce-abc", is("\"ce-abc-value\"")),
        ("ce-id", V::Any),
        ("ce-time", V::Any),
        ("ce-source", is("testsource")),
        ("ce-type", is("testtype")),
        ("ce-specversion", is("1.0")),
    ]));
    Expected {
        headers: list,
        body: "\"destination\"".to_owned(),
        exact: true,
    }
}

/// The answer of Knative's cases with an event and pass-through headers.
const EVENT_ANSWER_HEADERS: &[(&str, &str)] = &[
    ("do-not-passthrough", "no"),
    ("x-request-id", "altered-id"),
    ("knative-1", "new-knative-1-value"),
    ("ce-abc", "\"new-ce-abc-value\""),
    ("ce-id", "ignored-value-header"),
    ("ce-time", "2002-10-02T15:00:00Z"),
    ("ce-source", "testsource"),
    ("ce-type", "testtype"),
    ("ce-specversion", "1.0"),
];

/// The same answer's headers with the sender's `x-request-id` and `knative-1` (Knative's "no
/// restriction on message response size").
const EVENT_ANSWER_SAME_IDS: &[(&str, &str)] = &[
    ("do-not-passthrough", "no"),
    ("x-request-id", "id123"),
    ("knative-1", "knative-1-value"),
    ("ce-abc", "\"ce-abc-value\""),
    ("ce-id", "ignored-value-header"),
    ("ce-time", "2002-10-02T15:00:00Z"),
    ("ce-source", "testsource"),
    ("ce-type", "testtype"),
    ("ce-specversion", "1.0"),
];

/// Knative's expected reply: the answer's event and pass-through headers.
fn reply_of(request_id: &str, knative_1: &str, abc: &str, body: &str) -> Expected {
    Expected {
        headers: vec![
            ("x-request-id", is(request_id)),
            ("knative-1", is(knative_1)),
            ("traceparent", V::Any),
            ("ce-abc", is(abc)),
            ("ce-id", V::Any),
            ("ce-time", V::Any),
            ("ce-source", is("testsource")),
            ("ce-type", is("testtype")),
            ("ce-specversion", is("1.0")),
        ],
        body: body.to_owned(),
        exact: true,
    }
}

/// Knative's expected dead letter: the event, these pass-through headers, the error
/// attributes (`ce-knativeerrordest` is added where the case runs, as Knative's test does).
fn dead_letter(pass_through: &[(&'static str, V)], code: &str, data: &str) -> Expected {
    let mut list = pass_through.to_vec();
    list.extend(headers(&[
        ("traceparent", V::Any),
        ("ce-abc", is("\"ce-abc-value\"")),
        ("ce-knativeerrorcode", is(code)),
        ("ce-knativeerrordata", is(&b64(data.as_bytes()))),
        ("ce-id", V::Any),
        ("ce-time", V::Any),
        ("ce-source", is("testsource")),
        ("ce-type", is("testtype")),
        ("ce-specversion", is("1.0")),
    ]));
    Expected {
        headers: list,
        body: "\"destination\"".to_owned(),
        exact: true,
    }
}

fn sender_pass_through() -> Vec<(&'static str, V)> {
    headers(&[
        ("x-request-id", is("id123")),
        ("knative-1", is("knative-1-value")),
        ("knative-2", is("knative-2-value")),
    ])
}

fn answer_pass_through() -> Vec<(&'static str, V)> {
    headers(&[
        ("x-request-id", is("altered-id")),
        ("knative-1", is("new-knative-1-value")),
    ])
}

/// The dead letter of a failed reply as fanout sends it: the sender's headers.
fn reply_dead_letter_deviations() -> Vec<Deviation> {
    sender_pass_through()
        .into_iter()
        .map(|(header, fanout)| Deviation {
            leg: Leg::DeadLetter,
            header,
            fanout,
            why: REPLY_DEAD_LETTER_WHY,
        })
        .collect()
}

/// Knative's TestSendEvent table, and the plain-HTTP part of its TLS tests.
pub(super) fn dispatch_cases() -> Vec<DispatchCase> {
    let base = DispatchCase {
        knative: String::new(),
        sender_headers: true,
        sent: Sent::TestEvent("destination"),
        destination: answer(200, ""),
        reply: None,
        dead_letter: None,
        expected_err: false,
        expected: Vec::new(),
        error_dest: Leg::Destination,
        deviations: Vec::new(),
        otherwise: None,
    };
    let event_answer =
        |headers: &'static [(&'static str, &'static str)], body: &'static str| Answer {
            status: 202,
            headers,
            body,
        };
    let mut cases = vec![
        DispatchCase {
            knative: "destination - only".into(),
            expected: vec![(Leg::Destination, to_destination(true))],
            deviations: vec![no_prefer()],
            ..base.clone()
        },
        DispatchCase {
            knative: "destination - nil additional headers".into(),
            sender_headers: false,
            expected: vec![(Leg::Destination, to_destination(false))],
            deviations: vec![no_prefer()],
            ..base.clone()
        },
        DispatchCase {
            knative: "destination - only -- error".into(),
            destination: answer(404, "destination-response"),
            expected_err: true,
            expected: vec![(Leg::Destination, to_destination(true))],
            deviations: vec![no_prefer()],
            ..base.clone()
        },
        DispatchCase {
            knative: "destination and reply - dest returns bad status code".into(),
            destination: answer(500, "destination-response"),
            reply: Some(answer(200, "")),
            expected_err: true,
            expected: vec![(Leg::Destination, to_destination(true))],
            ..base.clone()
        },
        DispatchCase {
            knative: "destination and reply - dest returns empty body".into(),
            destination: event_answer(
                &[
                    ("do-not-passthrough", "no"),
                    ("x-request-id", "altered-id"),
                    ("knative-1", "new-knative-1-value"),
                    ("ce-abc", "\"new-ce-abc-value\""),
                ],
                "",
            ),
            reply: Some(answer(200, "")),
            expected: vec![(Leg::Destination, to_destination(true))],
            ..base.clone()
        },
        DispatchCase {
            knative: "destination and reply".into(),
            destination: event_answer(EVENT_ANSWER_HEADERS, "destination-response"),
            reply: Some(answer(200, "")),
            expected: vec![
                (Leg::Destination, to_destination(true)),
                (
                    Leg::Reply,
                    reply_of(
                        "altered-id",
                        "new-knative-1-value",
                        "\"new-ce-abc-value\"",
                        "destination-response",
                    ),
                ),
            ],
            ..base.clone()
        },
        DispatchCase {
            knative: "invalid destination and delivery option".into(),
            destination: answer(400, "destination-response"),
            dead_letter: Some(event_answer(
                EVENT_ANSWER_HEADERS,
                "deadlettersink-response",
            )),
            expected: vec![
                (Leg::Destination, to_destination(true)),
                (
                    Leg::DeadLetter,
                    dead_letter(&sender_pass_through(), "400", "destination-response"),
                ),
            ],
            deviations: vec![no_prefer()],
            ..base.clone()
        },
        DispatchCase {
            knative: "invalid destination and delivery option - deadletter reply without event"
                .into(),
            destination: answer(400, "destination-response"),
            dead_letter: Some(answer(202, "deadlettersink-response")),
            expected: vec![
                (Leg::Destination, to_destination(true)),
                (
                    Leg::DeadLetter,
                    dead_letter(&sender_pass_through(), "400", "destination-response"),
                ),
            ],
            deviations: vec![no_prefer()],
            ..base.clone()
        },
        DispatchCase {
            knative: "invalid reply and delivery option - deadletter reply without event".into(),
            destination: event_answer(EVENT_ANSWER_HEADERS, "destination-response"),
            reply: Some(answer(400, "reply-response-body")),
            dead_letter: Some(answer(202, "deadlettersink-response-body")),
            expected: vec![
                (Leg::Destination, to_destination(true)),
                (
                    Leg::Reply,
                    reply_of(
                        "altered-id",
                        "new-knative-1-value",
                        "\"new-ce-abc-value\"",
                        "destination-response",
                    ),
                ),
                (
                    Leg::DeadLetter,
                    dead_letter(&answer_pass_through(), "400", "reply-response-body"),
                ),
            ],
            error_dest: Leg::Reply,
            ..base.clone()
        },
        DispatchCase {
            knative: "destination and invalid reply and delivery option".into(),
            destination: event_answer(EVENT_ANSWER_HEADERS, "destination-response"),
            reply: Some(answer(400, "reply-response")),
            dead_letter: Some(event_answer(
                EVENT_ANSWER_HEADERS,
                "deadlettersink-response",
            )),
            expected: vec![
                (Leg::Destination, to_destination(true)),
                (
                    Leg::Reply,
                    reply_of(
                        "altered-id",
                        "new-knative-1-value",
                        "\"new-ce-abc-value\"",
                        "destination-response",
                    ),
                ),
                (
                    Leg::DeadLetter,
                    dead_letter(&answer_pass_through(), "400", "reply-response"),
                ),
            ],
            error_dest: Leg::Reply,
            ..base.clone()
        },
        DispatchCase {
            knative: "invalid characters in failed response body".into(),
            destination: answer(400, "destination\n multi-line\n response"),
            dead_letter: Some(event_answer(
                EVENT_ANSWER_HEADERS,
                "deadlettersink-response",
            )),
            expected: vec![
                (Leg::Destination, to_destination(true)),
                (
                    Leg::DeadLetter,
                    dead_letter(
                        &sender_pass_through(),
                        "400",
                        "destination\n multi-line\n response",
                    ),
                ),
            ],
            deviations: vec![no_prefer()],
            ..base.clone()
        },
        DispatchCase {
            knative: "no restriction on message response size".into(),
            destination: event_answer(EVENT_ANSWER_SAME_IDS, LONG_REPLY.as_str()),
            reply: Some(answer(200, "")),
            expected: vec![
                (Leg::Destination, to_destination(true)),
                (
                    Leg::Reply,
                    reply_of(
                        "id123",
                        "knative-1-value",
                        "\"ce-abc-value\"",
                        LONG_REPLY.as_str(),
                    ),
                ),
            ],
            ..base.clone()
        },
        DispatchCase {
            knative: "TestDispatchMessageToTLSEndpointWithReply (plain HTTP)".into(),
            sender_headers: false,
            sent: Sent::FullEvent,
            destination: Answer {
                status: 200,
                headers: &[("ce-id", "reply-id"), ("ce-specversion", "1.0")],
                body: "\"hello\"",
            },
            reply: Some(answer(200, "")),
            expected: vec![(
                Leg::Reply,
                Expected {
                    headers: headers(&[("ce-id", is("reply-id"))]),
                    body: "\"hello\"".to_owned(),
                    exact: false,
                },
            )],
            otherwise: Some(Otherwise {
                legs: vec![Leg::Destination],
                error: false,
                why: INVALID_REPLY_WHY,
            }),
            ..base.clone()
        },
        DispatchCase {
            knative: "TestDispatchMessageToTLSEndpointWithDeadLetterSink (plain HTTP)".into(),
            sender_headers: false,
            sent: Sent::FullEvent,
            destination: answer(500, ""),
            dead_letter: Some(answer(200, "")),
            expected: vec![(
                Leg::DeadLetter,
                Expected {
                    headers: headers(&[("ce-id", is("full-event"))]),
                    body: "\"hello\"".to_owned(),
                    exact: false,
                },
            )],
            ..base.clone()
        },
    ];
    // Knative's reply cases answer 202: fanout takes no reply from a 202. Each is replayed
    // as Knative wrote it, and answered 200, where it is a reply for fanout too.
    let mut answered_200 = Vec::new();
    for case in &mut cases {
        if case.reply.is_none() || case.destination.status != 202 {
            continue;
        }
        let mut other = case.clone();
        other.knative = format!("{} (answered 200)", case.knative);
        other.destination.status = 200;
        if other.error_dest == Leg::Reply {
            other.deviations.extend(reply_dead_letter_deviations());
        }
        answered_200.push(other);
        if case
            .expected
            .iter()
            .any(|(leg, _)| *leg != Leg::Destination)
        {
            case.otherwise = Some(Otherwise {
                legs: vec![Leg::Destination],
                error: false,
                why: A_202_WHY,
            });
        }
    }
    cases.extend(answered_200);
    cases
}

/// Knative's "no restriction on message response size": 2000 bytes.
static LONG_REPLY: LazyLock<String> = LazyLock::new(|| "a".repeat(2000));

/// The request a case's sender makes: the event (with `ce-time`, which Knative's receiver
/// adds before its dispatcher sees the event, and which fanout, passing the event on as it
/// came, never adds), and the pass-through headers.
fn dispatch_request(case: &DispatchCase, index: usize) -> (Vec<(String, String)>, String) {
    let owned = |list: &[(&str, &str)]| -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    };
    let (mut headers, body) = match case.sent {
        Sent::TestEvent(data) => {
            let mut headers = owned(&[("ce-specversion", "1.0")]);
            headers.push(("ce-id".to_owned(), format!("e-{index}")));
            headers.extend(owned(&[
                ("ce-time", "2026-12-02T02:00:00Z"),
                ("ce-source", "testsource"),
                ("ce-type", "testtype"),
                ("ce-abc", "\"ce-abc-value\""),
                ("content-type", "application/json"),
            ]));
            (headers, serde_json::to_string(data).unwrap())
        }
        Sent::FullEvent => full_event_in(Encoding::Binary, FormatData::FullEvent),
    };
    if case.sender_headers {
        headers.extend(owned(&[
            ("do-not-forward", "header"),
            ("x-request-id", "id123"),
            ("knative-1", "knative-1-value"),
            ("knative-2", "knative-2-value"),
        ]));
    }
    (headers, body)
}

/// Asserts that `got` is what `want` says, with `deviations` (and, untraced, the
/// suite-wide `traceparent`) applied.
fn assert_request(
    what: &str,
    got: &Recorded,
    want: &Expected,
    deviations: &[&Deviation],
    traced: bool,
) {
    let mut expected: BTreeMap<&str, V> = want.headers.iter().cloned().collect();
    let mut why: BTreeMap<&str, &str> = BTreeMap::new();
    if expected.contains_key("traceparent") && !traced {
        expected.insert("traceparent", V::Absent);
        why.insert("traceparent", TRACEPARENT_WHY);
    }
    for deviation in deviations {
        let knative = expected.get(deviation.header).unwrap_or(&V::Absent);
        assert_ne!(
            knative, &deviation.fanout,
            "{what}: {} is listed as a difference, yet fanout's is Knative's",
            deviation.header
        );
        expected.insert(deviation.header, deviation.fanout.clone());
        why.insert(deviation.header, deviation.why);
    }
    let differs = |name: &str| {
        why.get(name).map_or(String::new(), |why| {
            format!(" (where fanout differs: {why})")
        })
    };
    for (name, value) in &expected {
        match (value, got.header(name)) {
            (V::Any, Some(_)) | (V::Absent, None) => {}
            (V::Is(want), Some(have)) if want == have => {}
            (_, have) => panic!(
                "{what}: {name}: want {value:?}{}, got {have:?}: {got:#?}",
                differs(name)
            ),
        }
    }
    if want.exact {
        for (name, _) in got.headers.iter().filter(|(n, _)| compared(n)) {
            assert!(
                matches!(expected.get(name.as_str()), Some(V::Any | V::Is(_))),
                "{what}: {name} is not expected{}: {got:#?}",
                differs(name)
            );
        }
    }
    assert_eq!(
        String::from_utf8_lossy(&got.body),
        want.body,
        "{what}: body"
    );
}

#[test]
fn event_dispatcher_send_event() {
    replay_send_event(false);
}

/// The same table with `tracing` on (every request sampled, as Knative's dispatcher starts a
/// span for each): every request fanout sends carries a `traceparent`, as Knative's test
/// expects of each, the reply of "destination and reply" included. The collector is a
/// closed port: its spans are lost, which changes nothing else.
#[test]
fn event_dispatcher_send_event_traced() {
    replay_send_event(true);
}

fn replay_send_event(traced: bool) {
    struct Running {
        servers: BTreeMap<Leg, Subscriber>,
        host: String,
    }
    let cases = dispatch_cases();
    let mut builder = Envoy::builder();
    let mut channels = Vec::new();
    let mut running = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let mut servers = BTreeMap::new();
        servers.insert(
            Leg::Destination,
            Subscriber::start(&format!("d{i}-destination"), case.destination.behavior()),
        );
        if let Some(answer) = case.reply {
            servers.insert(
                Leg::Reply,
                Subscriber::start(&format!("d{i}-reply"), answer.behavior()),
            );
        }
        if let Some(answer) = case.dead_letter {
            servers.insert(
                Leg::DeadLetter,
                Subscriber::start(&format!("d{i}-dead-letter"), answer.behavior()),
            );
        }
        // Each target named by its URL as Knative's test names it (http://127.0.0.1:<port>/),
        // so that `knativeerrordest` can be compared as its test does.
        let target = |leg: Leg| {
            let server = &servers[&leg];
            let cluster = server.name().to_owned();
            (
                cluster.clone(),
                json!({ "cluster": cluster, "authority": format!("127.0.0.1:{}", server.port()),
                        "path": "/" }),
            )
        };
        let (cluster, mut subscriber) = target(Leg::Destination);
        builder = builder.cluster(&cluster, servers[&Leg::Destination].port());
        if servers.contains_key(&Leg::Reply) {
            let (cluster, reply) = target(Leg::Reply);
            builder = builder.cluster(&cluster, servers[&Leg::Reply].port());
            subscriber["reply"] = reply;
        }
        if servers.contains_key(&Leg::DeadLetter) {
            let (cluster, dead_letter) = target(Leg::DeadLetter);
            builder = builder.cluster(&cluster, servers[&Leg::DeadLetter].port());
            subscriber["delivery"] = json!({ "dead_letter": dead_letter });
        }
        let host = format!("d{i}.replay");
        channels
            .push(json!({ "name": format!("d{i}"), "hosts": [host], "subscribers": [subscriber] }));
        running.push(Running { servers, host });
    }
    // Knative's dispatcher is given no retry config in these cases: no retries. Every
    // forwarded header as fanout's default selects them (knative-*, x-request-id, ce-*).
    let mut config = json!({ "channels": channels });
    if traced {
        let closed = harness::free_ports(1)[0];
        builder = builder.cluster("otel", closed);
        config["tracing"] = json!({ "collector": { "cluster": "otel" }, "sampling_ratio": 1.0 });
    }
    let envoy = as_shipped(builder.fanout(&config)).start();
    for (i, (case, run)) in cases.iter().zip(&running).enumerate() {
        let what = case.knative.as_str();
        let (headers, body) = dispatch_request(case, i);
        let reply = post(&envoy, &run.host, &headers, &body);
        let error = case
            .otherwise
            .as_ref()
            .map_or(case.expected_err, |o| o.error);
        assert_eq!(
            reply.status,
            if error { 500 } else { 202 },
            "{what}: {}",
            reply.text()
        );
    }
    std::thread::sleep(SETTLE);
    for (case, run) in cases.iter().zip(&running) {
        let what = case.knative.as_str();
        let fanout_legs: Vec<Leg> = match &case.otherwise {
            Some(o) => o.legs.clone(),
            None => case.expected.iter().map(|(leg, _)| *leg).collect(),
        };
        if let Some(o) = &case.otherwise {
            let knative_legs: Vec<Leg> = case.expected.iter().map(|(leg, _)| *leg).collect();
            assert!(
                knative_legs != o.legs || case.expected_err != o.error,
                "{what}: listed as sending otherwise, yet it is what Knative expects"
            );
        }
        for leg in LEGS {
            let Some(server) = run.servers.get(&leg) else {
                continue;
            };
            let want = case.expected.iter().find(|(l, _)| *l == leg);
            let sends = fanout_legs.contains(&leg);
            // Knative's table leaves some requests unchecked (the destination of its TLS
            // reply case): fanout sends them all the same.
            let unchecked = want.is_none() && leg == Leg::Destination;
            if unchecked {
                has_exactly(server, 1, what);
                continue;
            }
            if !sends {
                has_exactly(server, 0, &format!("{what}: {leg:?}"));
                continue;
            }
            let (_, want) = want.unwrap();
            let mut want = want.clone();
            if leg == Leg::DeadLetter && want.exact {
                let dest = &run.servers[&case.error_dest];
                want.headers.push((
                    "ce-knativeerrordest",
                    V::Is(format!("http://127.0.0.1:{}/", dest.port())),
                ));
            }
            has_exactly(server, 1, &format!("{what}: {leg:?}"));
            let deviations: Vec<&Deviation> =
                case.deviations.iter().filter(|d| d.leg == leg).collect();
            assert_request(
                &format!("{what}: {leg:?}"),
                &server.requests()[0],
                &want,
                &deviations,
                traced,
            );
        }
    }
}

#[test]
fn event_dispatcher_reply_only_has_no_destination_and_is_refused() {
    // Knative's "reply - only": no destination, an error ("can not dispatch message to nil
    // destination.URL"). A subscriber without a cluster is a configuration fanout refuses,
    // naming the field.
    let (status, log) = Envoy::builder()
        .cluster("reply", 9)
        .fanout(&json!({ "subscribers": [{ "reply": { "cluster": "reply" } }] }))
        .start_expecting_failure();
    assert!(!status.success(), "{log}");
    assert!(log.contains("subscribers[0]"), "{log}");
    assert!(log.contains("cluster"), "{log}");
}
