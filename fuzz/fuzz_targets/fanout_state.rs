//! The per-request state machine (`fanout::fan_out_state::FanOut`) fed arbitrary sequences of
//! callbacks: calls handed out, dispatched (with any token, including one already in use) or
//! refused at dispatch, answered with any token (unknown, late, duplicate) and any status,
//! body, `retry-after` and reply (or a reply too large); subscribers skipped; the clock moving; indexes out of range.
//! The channel is drawn from the input too: retries, backoff, dead-letter and reply targets.
//!
//! Two drivers: one calls the API in any order; the other drives it the way the filter does
//! (every call handed out is dispatched or refused at once, tokens are unique, the answer goes
//! out when the fan-out is done). Properties:
//! - nothing panics;
//! - a call is handed out only when it is not already under way; `dispatched` and
//!   `dispatch_failed` act only on a call handed out; `completed` ends the call waiting for
//!   that token and reports its index, and changes nothing for a token no call waits for;
//! - `open()` never grows, `is_done()` holds exactly when it is 0, and a done fan-out has no
//!   call under way, ready or waiting;
//! - no subscriber's event is attempted more than `retry + 1` times;
//! - once done, the verdict is 202 iff no subscriber failed for good, else a 500 report that
//!   lists exactly the failed ones (`x-fanout-failed` = their number) and accounts for every
//!   subscriber; nothing that comes late changes it;
//! - every header value made from a subscriber's answer (report headers, dead-letter headers,
//!   binary or structured) is a valid header value, a structured dead letter's body is still
//!   JSON, and every detail quoted is free of control characters;
//! - driven like the filter and then given every answer it waits for (2xx), it finishes: the
//!   request is answered exactly once.
#![no_main]

use std::collections::BTreeSet;

use arbitrary::{Arbitrary, Unstructured};
use fanout::answer::DEAD_LETTERED_HEADER;
use fanout::answer::FAILED_HEADER;
use fanout::call::{classify, Failure, BODY_PEEK_BYTES, DETAIL_BYTES};
use fanout::config::{Channel, Config};
use fanout::fan_out_state::{CallEnd, FanOut, ReplyEvent};
use fanout::headers::{is_token_byte, is_valid_value, Forwarded};
use fanout::metrics::Tally;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

#[derive(Arbitrary, Debug)]
struct SubSpec {
    retry: u8,
    linear: bool,
    delay_ms: u8,
    max_ms: u16,
    dead_letter: bool,
    reply: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// `take_ready(now)`; the filter-like driver then dispatches every send at once, refusing
    /// those whose bit is set in `refuse`.
    TakeReady {
        refuse: u64,
    },
    /// `dispatched` for the `pick`th call handed out and not yet reported (any driver), or
    /// for any index (any-order driver).
    Dispatch {
        pick: u8,
        token: u8,
        raw: bool,
    },
    DispatchFail {
        pick: u8,
        detail: Vec<u8>,
        raw: bool,
    },
    Skip {
        index: u8,
    },
    /// `completed` with the token of a call under way (`back` picks which), or any token.
    Complete {
        back: u8,
        any: Option<u32>,
        end: End,
    },
    Clock {
        ms: u16,
    },
    /// Move the clock to the next retry's time.
    Wakeup,
}

#[derive(Arbitrary, Debug)]
struct End {
    kind: u8,
    status: Option<u16>,
    body: Vec<u8>,
    retry_after_ms: Option<u32>,
    /// A 2xx's reply event: (header name pick, value) pairs and a body.
    reply: Option<ReplyParts>,
    /// The reply was larger than max_body_bytes instead.
    reply_too_large: bool,
}

type ReplyParts = (Vec<(u8, Vec<u8>)>, Vec<u8>);

impl End {
    fn call_end(&self) -> CallEnd {
        let (status, body): (Option<u16>, &[u8]) = match self.kind % 8 {
            0 | 1 => (Some(200), b""),
            2 => (Some(504), b"upstream request timeout"),
            3 => (
                Some(503),
                b"upstream connect error or disconnect/reset before headers. reset reason: connection failure",
            ),
            4 => (None, b""),
            5 => (
                Some(503),
                b"upstream connect error or disconnect/reset before headers. reset reason: overflow",
            ),
            _ => (self.status, &self.body),
        };
        let body = &body[..body.len().min(BODY_PEEK_BYTES)];
        let result = classify("fuzzed", status, body);
        match (&result, status) {
            (Ok(()), Some(s)) => assert!((200..300).contains(&s)),
            (Ok(()), None) => panic!("no status counted as a success"),
            (Err(_), Some(s)) => assert!(!(200..300).contains(&s)),
            (Err(f), None) => assert_eq!(*f, Failure::NoResponse),
        }
        if let Err(Failure::Status { detail, .. } | Failure::Reset { detail }) = &result {
            assert!(!detail.chars().any(char::is_control), "{detail:?}");
        }
        let reply = match (&result, &self.reply) {
            (Ok(()), Some(_)) if self.reply_too_large => Some(Err(Failure::TooLarge {
                size: body.len() + 1,
                limit: body.len() as u64,
            })),
            (Ok(()), Some((headers, body))) => Some(Ok(ReplyEvent {
                headers: headers
                    .iter()
                    .map(|(n, v)| {
                        (
                            ["content-type", "ce-id", "ce-type", "ce-source"][usize::from(*n) % 4]
                                .to_owned(),
                            String::from_utf8_lossy(v).into_owned(),
                        )
                    })
                    .collect(),
                body: body.clone(),
            })),
            _ => None,
        };
        CallEnd {
            result,
            retry_after_ms: self.retry_after_ms.map(u64::from),
            body: body.to_vec(),
            reply,
        }
    }
}

#[derive(Debug)]
struct Input {
    subs: Vec<SubSpec>,
    filter_like: bool,
    ops: Vec<Op>,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let n = u.int_in_range(0..=12)?;
        let subs = (0..n)
            .map(|_| SubSpec::arbitrary(u))
            .collect::<Result<_, _>>()?;
        Ok(Input {
            subs,
            filter_like: u.arbitrary()?,
            ops: u.arbitrary()?,
        })
    }
}

fn channel(subs: &[SubSpec]) -> std::rc::Rc<Channel> {
    let subscribers: Vec<Value> = subs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut delivery = json!({
                "retry": s.retry % 4,
                "backoff_policy": if s.linear { "linear" } else { "exponential" },
                "backoff_delay_ms": s.delay_ms,
                "backoff_max_ms": s.max_ms,
            });
            if s.dead_letter {
                delivery["dead_letter"] = json!({ "cluster": format!("dl{i}"), "timeout_ms": 7 });
            }
            let mut sub = json!({
                "cluster": format!("c{i}"), "path": format!("/p{i}"), "timeout_ms": i + 1,
                "delivery": delivery,
            });
            if s.reply {
                sub["reply"] = json!({ "cluster": format!("r{i}"), "path": "/reply" });
            }
            sub
        })
        .collect();
    let doc = json!({ "subscribers": subscribers });
    let mut config = Config::from_json(doc.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("the harness's config is refused: {e}"));
    config.channels.remove(0)
}

/// What the driver knows: calls handed out and not reported, and calls under way.
struct Model {
    sending: BTreeSet<usize>,
    pending: Vec<Option<u32>>,
    ever_sent: BTreeSet<usize>,
    skipped: BTreeSet<usize>,
}

impl Model {
    fn waiting_for(&self, token: u32) -> Option<usize> {
        self.pending.iter().position(|p| *p == Some(token))
    }
}

fuzz_target!(|input: Input| {
    let channel = channel(&input.subs);
    let n = channel.subscribers.len();
    let mut tally = Tally::default();
    for s in &channel.subscribers {
        tally.register_subscriber(&s.cluster);
    }
    let mut now: u64 = 1_000;
    let mut f = FanOut::new(n, now);
    let mut m = Model {
        sending: BTreeSet::new(),
        pending: vec![None; n],
        ever_sent: BTreeSet::new(),
        skipped: BTreeSet::new(),
    };
    let mut next_token: u32 = 0;
    let mut answers = 0usize;
    let mut answer = None;
    let mut open = f.open();
    assert_eq!(open, n);

    // `None` first: a fan-out with no subscriber is done at once, and answered then.
    let ops = std::iter::once(None).chain(input.ops.iter().map(Some));
    for op in ops {
        if let Some(op) = op {
            step(
                &mut f,
                &mut m,
                &channel,
                &mut tally,
                op,
                input.filter_like,
                &mut now,
                &mut next_token,
            );
        }
        check(&f, &m, &channel, &input.subs, &mut open);
        if f.is_done() {
            match &answer {
                None => {
                    answers += 1;
                    let verdict = f.verdict(&channel);
                    tally.answered(verdict.status);
                    answer = Some(verdict);
                }
                Some(first) => assert_eq!(&f.verdict(&channel), first, "the verdict changed"),
            }
        }
    }
    if !input.filter_like {
        return;
    }
    // Give it every answer it waits for: a 2xx, at once, with a fresh token per call.
    for _ in 0..64 {
        if f.is_done() {
            break;
        }
        if let Some(t) = f.next_wakeup() {
            now = now.max(t);
        }
        step(
            &mut f,
            &mut m,
            &channel,
            &mut tally,
            &Op::TakeReady { refuse: 0 },
            true,
            &mut now,
            &mut next_token,
        );
        for i in 0..n {
            if let Some(token) = m.pending[i] {
                let got = f.completed(token, CallEnd::ok(), now, &channel);
                assert_eq!(got, m.waiting_for(token));
                m.pending[i] = None;
            }
        }
        check(&f, &m, &channel, &input.subs, &mut open);
        if f.is_done() && answer.is_none() {
            answers += 1;
            answer = Some(f.verdict(&channel));
        }
    }
    assert!(
        f.is_done(),
        "given every answer, the fan-out did not finish: {f:?}"
    );
    assert_eq!(answers, 1);
    let _ = tally.flush();
});

#[allow(clippy::too_many_arguments)]
fn step(
    f: &mut FanOut,
    m: &mut Model,
    channel: &Channel,
    tally: &mut Tally,
    op: &Op,
    filter_like: bool,
    now: &mut u64,
    next_token: &mut u32,
) {
    let n = channel.subscribers.len();
    match op {
        Op::TakeReady { refuse } => {
            let sends = f.take_ready(*now);
            let indexes: Vec<usize> = sends.iter().map(|s| s.index).collect();
            let unique: BTreeSet<usize> = indexes.iter().copied().collect();
            assert_eq!(unique.len(), indexes.len(), "handed out twice: {indexes:?}");
            for &i in &indexes {
                assert!(i < n);
                assert!(
                    !m.sending.contains(&i),
                    "{i} handed out again before it was reported"
                );
                assert!(m.pending[i].is_none(), "{i} handed out while under way");
                assert!(!m.skipped.contains(&i), "skipped {i} handed out");
                m.sending.insert(i);
                m.ever_sent.insert(i);
            }
            if filter_like {
                for (k, send) in sends.iter().enumerate() {
                    let at = tally.cluster(&channel.subscribers[send.index].cluster);
                    tally.call_started(at);
                    if k < 64 && refuse >> k & 1 == 1 {
                        f.dispatch_failed(
                            send.index,
                            Failure::DispatchError {
                                detail: "unknown cluster".into(),
                            },
                            *now,
                            channel,
                        );
                        m.sending.remove(&send.index);
                    } else {
                        *next_token += 1;
                        f.dispatched(send.index, *next_token);
                        m.sending.remove(&send.index);
                        m.pending[send.index] = Some(*next_token);
                    }
                }
            }
        }
        Op::Dispatch { pick, token, raw } => {
            if filter_like {
                return;
            }
            let index = pick_index(m, *pick, *raw);
            let token = u32::from(*token);
            f.dispatched(index, token);
            if m.sending.remove(&index) {
                m.pending[index] = Some(token);
            }
        }
        Op::DispatchFail { pick, detail, raw } => {
            if filter_like {
                return;
            }
            let index = pick_index(m, *pick, *raw);
            let detail = String::from_utf8_lossy(detail).into_owned();
            f.dispatch_failed(index, Failure::DispatchError { detail }, *now, channel);
            m.sending.remove(&index);
        }
        Op::Skip { index } => {
            let i = usize::from(*index);
            let before = f.open();
            f.skip(i);
            let effective = i < n && !m.ever_sent.contains(&i) && !m.skipped.contains(&i);
            if effective {
                m.skipped.insert(i);
                assert_eq!(f.open(), before - 1, "skip({i}) did not end the call");
            } else {
                assert_eq!(
                    f.open(),
                    before,
                    "skip({i}) changed a call already under way"
                );
            }
        }
        Op::Complete { back, any, end } => {
            let token = match any {
                Some(t) => *t,
                None => {
                    let under_way: Vec<u32> = m.pending.iter().flatten().copied().collect();
                    if under_way.is_empty() {
                        u32::from(*back)
                    } else {
                        under_way[usize::from(*back) % under_way.len()]
                    }
                }
            };
            let expected = m.waiting_for(token);
            assert_eq!(f.leg_of(token).map(|(i, _)| i), expected);
            let end = end.call_end();
            let result = end.result.clone();
            let got = f.completed(token, end, *now, channel);
            assert_eq!(got, expected, "completed({token}) ended the wrong call");
            if let Some(i) = got {
                m.pending[i] = None;
                let at = tally.cluster(&channel.subscribers[i].cluster);
                tally.call_ended(at, &result, Some(3));
            }
        }
        Op::Clock { ms } => *now += u64::from(*ms),
        Op::Wakeup => {
            if let Some(t) = f.next_wakeup() {
                *now = (*now).max(t);
            }
        }
    }
}

fn pick_index(m: &Model, pick: u8, raw: bool) -> usize {
    if raw || m.sending.is_empty() {
        usize::from(pick)
    } else {
        *m.sending
            .iter()
            .nth(usize::from(pick) % m.sending.len())
            .unwrap_or(&0)
    }
}

fn check(f: &FanOut, m: &Model, channel: &Channel, subs: &[SubSpec], open: &mut usize) {
    let n = channel.subscribers.len();
    let structured = [(
        "content-type".to_string(),
        "application/cloudevents+json".to_string(),
    )];
    assert!(
        f.open() <= *open,
        "open went up from {open} to {}",
        f.open()
    );
    *open = f.open();
    assert_eq!(f.is_done(), f.open() == 0);
    let busy = m.sending.len() + m.pending.iter().flatten().count();
    assert!(
        f.open() >= busy,
        "open {} < calls under way {busy}",
        f.open()
    );
    for (i, p) in m.pending.iter().enumerate() {
        if let Some(t) = p {
            // The first call waiting for a token is the one a callback with it ends.
            assert_eq!(f.leg_of(*t).map(|(j, _)| j), m.waiting_for(*t), "call {i}");
        }
    }
    for (i, spec) in subs.iter().enumerate() {
        assert!(
            f.event_attempts(i) <= u32::from(spec.retry % 4) + 1,
            "subscriber {i}: {} attempts with retry {}",
            f.event_attempts(i),
            spec.retry % 4
        );
        // The structured form (a JSON parse) once the fan-out is done, to keep the steps fast.
        let modes = [
            (Forwarded::default(), &b"plain"[..]),
            (
                structured.iter().cloned().collect(),
                br#"{"id":"1","data":{"a":[1,2]}}"#,
            ),
        ];
        for (forwarded, event) in &modes[..if f.is_done() { 2 } else { 1 }] {
            let letter = f.dead_letter(i, channel, forwarded, event);
            for (name, value) in &letter.headers {
                assert!(
                    !name.is_empty() && name.bytes().all(is_token_byte),
                    "{name:?}"
                );
                assert!(
                    is_valid_value(value),
                    "dead-letter header {name}: {value:?}"
                );
            }
            if let Some(body) = &letter.body {
                let doc: Value = serde_json::from_slice(body).expect("the dead letter is JSON");
                assert!(doc["knativeerrorcode"].is_u64(), "{doc}");
            }
        }
    }
    let failures: Vec<(usize, Failure)> = f.failures().map(|(i, x)| (i, x.clone())).collect();
    for i in 0..n {
        assert_eq!(f.is_failed(i), failures.iter().any(|(j, _)| *j == i));
    }
    for (i, _) in &failures {
        assert!(!m.skipped.contains(i), "skipped {i} failed");
    }
    if !f.is_done() {
        return;
    }
    assert!(busy == 0, "done with calls under way");
    assert!(!f.has_ready());
    assert_eq!(f.next_wakeup(), None);
    assert_eq!(f.waiting(), 0);
    let answer = f.verdict(channel);
    for (name, value) in answer.header_pairs() {
        assert!(is_valid_value(value), "{name}: {value:?}");
    }
    let dead_lettered_header = answer
        .header_pairs()
        .iter()
        .find(|(h, _)| *h == DEAD_LETTERED_HEADER)
        .map(|(_, v)| v.parse::<usize>().expect("a number"));
    if failures.is_empty() {
        assert_eq!(answer.status, 202);
        assert!(answer.body.is_empty());
        return;
    }
    assert_eq!(answer.status, 500);
    let count = failures.len().to_string();
    assert!(answer
        .header_pairs()
        .contains(&(FAILED_HEADER, count.as_str())));
    let report: Value = serde_json::from_slice(&answer.body).expect("the report is JSON");
    assert_eq!(report["subscribers"], n);
    let failed = report["failed"].as_array().expect("a failed list");
    assert_eq!(failed.len(), failures.len());
    let dead = report["dead_lettered"].as_array().map_or(0, Vec::len);
    let skipped = report["skipped"].as_array().map_or(0, Vec::len);
    assert_eq!(skipped, m.skipped.len());
    assert_eq!(dead_lettered_header, (dead > 0).then_some(dead));
    let delivered = report["delivered"].as_u64().expect("delivered") as usize;
    assert_eq!(
        delivered + failed.len() + dead + skipped,
        n,
        "the report does not account for every subscriber: {report}"
    );
    for (entry, (i, failure)) in failed.iter().zip(&failures) {
        let sub = &channel.subscribers[*i];
        assert_eq!(entry["cluster"], sub.cluster.as_str());
        assert_eq!(entry["outcome"], failure.kind());
        let detail = entry["detail"].as_str().expect("a detail");
        // A dispatch error's detail is Envoy's, not a subscriber's: only those are checked.
        if !matches!(failure, Failure::DispatchError { .. }) {
            assert!(!detail.chars().any(char::is_control), "{detail:?}");
            assert!(detail.len() <= DETAIL_BYTES + 3, "{} bytes", detail.len());
        }
    }
}
