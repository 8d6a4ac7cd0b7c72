use super::*;
use crate::answer::{Answer, ALREADY_DELIVERED_HEADER, DEAD_LETTERED_HEADER, FAILED_HEADER};
use crate::config::Config;
use crate::dead_letter::{
    DEAD_LETTER_ATTEMPTS, DEAD_LETTER_BODY, DEAD_LETTER_CLUSTER, DEAD_LETTER_LEG,
    DEAD_LETTER_OUTCOME, DEAD_LETTER_STATUS,
};
use base64::Engine;
use std::rc::Rc;

fn dispatch_error(detail: &str) -> Failure {
    Failure::DispatchError {
        detail: detail.into(),
    }
}

fn channel_from(json: &str) -> Rc<Channel> {
    let mut config = Config::from_json(json.as_bytes()).unwrap();
    config.channels.remove(0)
}

fn channel(n: usize) -> Rc<Channel> {
    let subs: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"cluster": "c{i}", "path": "/p{i}", "timeout_ms": 250}}"#))
        .collect();
    channel_from(&format!(r#"{{"subscribers": [{}]}}"#, subs.join(",")))
}

fn report(answer: &Answer) -> serde_json::Value {
    serde_json::from_slice(&answer.body).unwrap()
}

fn status(s: u16) -> CallEnd {
    CallEnd::failed(Failure::Status {
        status: s,
        detail: format!("answered {s}"),
    })
}

/// Sends everything ready, giving tokens from `next`; returns the sends.
fn send_all(f: &mut FanOut, now: u64, next: &mut u32) -> Vec<(ReadyCall, u32)> {
    let sends = f.take_ready(now);
    sends
        .into_iter()
        .map(|send| {
            *next += 1;
            f.dispatched(send.index, *next);
            (send, *next)
        })
        .collect()
}

#[test]
fn every_subscriber_is_sent_the_event_once() {
    let mut f = FanOut::new(3, 0);
    let sends = f.take_ready(0);
    assert_eq!(
        sends,
        (0..3)
            .map(|index| ReadyCall {
                index,
                leg: Leg::Event
            })
            .collect::<Vec<_>>()
    );
    assert!(f.take_ready(0).is_empty(), "sent twice");
}

#[test]
fn all_delivered_is_202() {
    let ch = channel(3);
    let mut f = FanOut::new(3, 1000);
    let mut next = 9;
    send_all(&mut f, 1000, &mut next);
    assert!(!f.is_done());
    assert_eq!(f.completed(11, CallEnd::ok(), 1001, &ch), Some(1));
    assert_eq!(f.completed(10, CallEnd::ok(), 1002, &ch), Some(0));
    assert_eq!(f.open(), 1);
    assert_eq!(f.completed(12, CallEnd::ok(), 1003, &ch), Some(2));
    assert!(f.is_done());
    assert_eq!(f.verdict(&ch), Answer::accepted());
}

#[test]
fn no_subscribers_is_done_at_once_and_202() {
    let f = FanOut::new(0, 0);
    assert!(f.is_done());
    assert_eq!(f.verdict(&channel(0)).status, 202);
}

#[test]
fn one_failure_makes_a_500_report_naming_it() {
    let ch = channel(3);
    let mut f = FanOut::new(3, 1000);
    let mut next = 0;
    send_all(&mut f, 1000, &mut next);
    f.completed(2, CallEnd::ok(), 1005, &ch);
    f.completed(3, status(500), 1042, &ch);
    f.completed(1, CallEnd::ok(), 1043, &ch);
    assert!(f.is_done());
    let answer = f.verdict(&ch);
    assert_eq!(answer.status, 500);
    assert!(answer.headers.contains(&(FAILED_HEADER, "1".to_string())));
    assert!(answer
        .headers
        .contains(&("content-type", "application/json".to_string())));
    let doc = report(&answer);
    assert_eq!(doc["channel"], "default");
    assert_eq!(doc["subscribers"], 3);
    assert_eq!(doc["delivered"], 2);
    let failed = doc["failed"].as_array().unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["cluster"], "c2");
    assert_eq!(failed[0]["path"], "/p2");
    assert_eq!(failed[0]["leg"], "event");
    assert_eq!(failed[0]["outcome"], "status");
    assert_eq!(failed[0]["status"], 500);
    assert_eq!(failed[0]["detail"], "answered 500");
    assert_eq!(failed[0]["attempts"], 1);
    assert_eq!(failed[0]["elapsed_ms"], 42);
    assert_eq!(doc["skipped"], serde_json::json!([]));
    assert_eq!(doc["dead_lettered"], serde_json::json!([]));
}

#[test]
fn a_full_report_lists_the_subscribers_that_took_the_event() {
    let ch = channel(2);
    let mut f = FanOut::new(2, 0).with_full_report(true);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, CallEnd::ok(), 1, &ch);
    f.completed(2, status(500), 1, &ch);
    let doc = report(&f.verdict(&ch));
    assert_eq!(
        doc["succeeded"],
        serde_json::json!([{"cluster": "c0", "authority": "c0", "path": "/p0",
                            "dead_lettered": false, "attempts": 1}])
    );
    // Not listed by default.
    let mut f = FanOut::new(2, 0);
    send_all(&mut f, 0, &mut next);
    f.completed(3, CallEnd::ok(), 1, &ch);
    f.completed(4, status(500), 1, &ch);
    assert!(report(&f.verdict(&ch)).get("succeeded").is_none());
}

#[test]
fn giving_up_fails_what_is_still_open() {
    let ch = channel(3);
    let mut f = FanOut::new(3, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, CallEnd::ok(), 1, &ch);
    f.give_up(500);
    assert!(f.is_done());
    let doc = report(&f.verdict(&ch));
    assert_eq!(doc["delivered"], 1);
    assert_eq!(doc["failed"][0]["outcome"], "no_response");
    assert_eq!(doc["failed"][1]["elapsed_ms"], 500);
    // a late answer changes nothing
    assert_eq!(f.completed(2, CallEnd::ok(), 600, &ch), None);
}

#[test]
fn a_refused_call_fails_at_once() {
    let ch = channel(2);
    let mut f = FanOut::new(2, 0);
    let sends = f.take_ready(0);
    assert_eq!(sends.len(), 2);
    f.dispatched(0, 1);
    f.dispatch_failed(1, dispatch_error("unknown cluster"), 3, &ch);
    assert_eq!(f.open(), 1);
    f.completed(1, CallEnd::ok(), 4, &ch);
    let doc = report(&f.verdict(&ch));
    assert_eq!(doc["failed"][0]["cluster"], "c1");
    assert_eq!(doc["failed"][0]["outcome"], "dispatch_error");
    assert_eq!(doc["failed"][0]["detail"], "unknown cluster");
    assert_eq!(doc["failed"][0]["attempts"], 1);
    assert!(doc["failed"][0].get("status").is_none());
}

#[test]
fn timeout_report_says_the_timeout() {
    let ch = channel(1);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, CallEnd::failed(Failure::Timeout), 251, &ch);
    let doc = report(&f.verdict(&ch));
    assert_eq!(doc["failed"][0]["outcome"], "timeout");
    assert_eq!(
        doc["failed"][0]["detail"],
        "no answer within the timeout of 250 ms"
    );
}

#[test]
fn late_unknown_and_duplicate_tokens_are_ignored() {
    let ch = channel(2);
    let mut f = FanOut::new(2, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    assert_eq!(
        f.completed(99, CallEnd::ok(), 0, &ch),
        None,
        "unknown token"
    );
    assert_eq!(
        f.completed(1, CallEnd::failed(Failure::NoResponse), 0, &ch),
        Some(0)
    );
    assert_eq!(
        f.completed(1, CallEnd::ok(), 0, &ch),
        None,
        "duplicate token"
    );
    assert_eq!(f.open(), 1);
    assert_eq!(f.completed(2, CallEnd::ok(), 0, &ch), Some(1));
    assert_eq!(f.completed(2, status(500), 0, &ch), None, "late token");
    assert_eq!(f.failures().count(), 1);
    assert_eq!(f.verdict(&ch).status, 500);
}

#[test]
fn dedupe_marks_are_named_in_every_answer_and_kept_apart_from_filter_skips() {
    let ch = channel(3);
    // All already delivered: 202 at once, saying so.
    let mut f = FanOut::new(3, 0);
    (0..3).for_each(|i| f.already_delivered(i));
    assert!(f.is_done());
    assert!(f.take_ready(0).is_empty());
    let answer = f.verdict(&ch);
    assert_eq!(answer.status, 202);
    assert!(answer
        .headers
        .contains(&(ALREADY_DELIVERED_HEADER, "3".to_string())));
    let doc = report(&answer);
    assert_eq!(
        doc["already_delivered"],
        serde_json::json!(["c0", "c1", "c2"])
    );
    assert_eq!(doc["delivered"], 0);
    assert_eq!(doc["skipped"], serde_json::json!([]));
    assert!(doc.get("in_progress").is_none());

    // One already delivered, one delivered, one failed: 500 naming both.
    let mut f = FanOut::new(3, 0);
    f.already_delivered(0);
    let mut next = 0;
    assert_eq!(send_all(&mut f, 0, &mut next).len(), 2);
    f.completed(1, CallEnd::ok(), 0, &ch);
    f.completed(2, CallEnd::failed(Failure::NoResponse), 0, &ch);
    assert!(f.is_delivered(1) && !f.is_delivered(0) && !f.is_delivered(2));
    let answer = f.verdict(&ch);
    assert_eq!(answer.status, 500);
    let doc = report(&answer);
    assert_eq!(doc["already_delivered"], serde_json::json!(["c0"]));
    assert_eq!(doc["failed"][0]["cluster"], "c2");

    // In progress elsewhere, skipped by a filter, nothing failed: 409, retry.
    let mut f = FanOut::new(3, 0);
    f.in_progress_elsewhere(0);
    f.skip(1);
    // A subscriber's state is set once: a later mark changes nothing.
    f.already_delivered(1);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, CallEnd::ok(), 0, &ch);
    assert!(f.is_done());
    let answer = f.verdict(&ch);
    assert_eq!(answer.status, 409);
    assert!(answer.headers.contains(&("retry-after", "1".to_string())));
    let doc = report(&answer);
    assert_eq!(doc["in_progress"], serde_json::json!(["c0"]));
    assert_eq!(doc["skipped"], serde_json::json!(["c1"]));
    assert!(doc.get("already_delivered").is_none());
    assert_eq!(doc["failed"], serde_json::json!([]));
}

#[test]
fn a_call_is_dispatched_or_refused_once() {
    let ch = channel(1);
    let mut f = FanOut::new(1, 0);
    f.take_ready(0);
    f.dispatched(0, 1);
    f.dispatch_failed(0, dispatch_error("late"), 0, &ch);
    f.dispatched(0, 2);
    assert_eq!(f.completed(2, CallEnd::ok(), 0, &ch), None);
    assert_eq!(f.completed(1, CallEnd::ok(), 0, &ch), Some(0));
    assert!(f.is_done());
    // out-of-range indexes change nothing
    f.dispatched(5, 3);
    f.dispatch_failed(5, dispatch_error("x"), 0, &ch);
    assert!(f.is_done());
}

#[test]
fn skipped_subscribers_are_done_and_not_failures() {
    let ch = channel(3);
    let mut f = FanOut::new(3, 0);
    f.skip(0);
    f.skip(2);
    assert_eq!(
        f.take_ready(0),
        vec![ReadyCall {
            index: 1,
            leg: Leg::Event
        }]
    );
    f.dispatched(1, 1);
    assert_eq!(f.open(), 1);
    assert_eq!(f.skipped(), 2);
    assert!(f.completed(1, CallEnd::ok(), 0, &ch).is_some());
    assert!(f.is_done());
    assert_eq!(f.verdict(&ch), Answer::accepted());
}

#[test]
fn skipped_subscribers_are_never_sent_and_the_report_lists_them_apart_from_failed() {
    let ch = channel(4);
    let mut f = FanOut::new(4, 0);
    f.skip(0);
    f.skip(3);
    let mut next = 0;
    let sent = send_all(&mut f, 0, &mut next);
    let indexes: Vec<usize> = sent.iter().map(|(send, _)| send.index).collect();
    assert_eq!(indexes, [1, 2]);
    // A call under way cannot be skipped any more.
    f.skip(1);
    assert_eq!(f.skipped(), 2);
    f.completed(sent[0].1, CallEnd::ok(), 0, &ch);
    f.completed(sent[1].1, status(503), 0, &ch);
    assert!(f.is_done());
    let answer = f.verdict(&ch);
    assert_eq!(answer.status, 500);
    assert!(answer.headers.contains(&(FAILED_HEADER, "1".to_string())));
    let doc = report(&answer);
    assert_eq!(doc["subscribers"], 4);
    assert_eq!(doc["delivered"], 1);
    assert_eq!(doc["failed"].as_array().unwrap().len(), 1);
    assert_eq!(doc["failed"][0]["cluster"], "c2");
    assert_eq!(doc["skipped"], serde_json::json!(["c0", "c3"]));
}

#[test]
fn all_skipped_is_done_at_once_and_202() {
    let ch = channel(2);
    let mut f = FanOut::new(2, 0);
    f.skip(0);
    f.skip(1);
    assert!(f.is_done());
    assert_eq!(f.verdict(&ch), Answer::accepted());
}

const RETRYING: &str = r#"{"delivery": {"retry": 2, "backoff_policy": "linear",
    "backoff_delay_ms": 100, "backoff_max_ms": 1000},
    "subscribers": [{"cluster": "a"}]}"#;

#[test]
fn a_retryable_failure_waits_its_backoff_then_is_sent_again() {
    let ch = channel_from(RETRYING);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, status(503), 10, &ch);
    assert!(!f.is_done());
    assert_eq!(f.next_wakeup(), Some(110), "linear: 100 ms before retry 1");
    assert!(f.take_ready(109).is_empty());
    assert_eq!(send_all(&mut f, 110, &mut next).len(), 1);
    f.completed(2, CallEnd::failed(Failure::Timeout), 300, &ch);
    assert_eq!(f.next_wakeup(), Some(500), "linear: 200 ms before retry 2");
    send_all(&mut f, 500, &mut next);
    f.completed(3, CallEnd::ok(), 510, &ch);
    assert!(f.is_done());
    assert_eq!(f.event_attempts(0), 3);
    assert_eq!(f.verdict(&ch), Answer::accepted());
}

#[test]
fn retries_run_out_and_the_report_counts_the_attempts() {
    let ch = channel_from(RETRYING);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    for now in [0, 1000, 2000] {
        send_all(&mut f, now, &mut next);
        f.completed(next, status(500), now + 1, &ch);
    }
    assert!(f.is_done());
    let doc = report(&f.verdict(&ch));
    assert_eq!(doc["failed"][0]["attempts"], 3);
    assert_eq!(doc["failed"][0]["status"], 500);
    assert_eq!(doc["failed"][0]["elapsed_ms"], 2001);
}

#[test]
fn a_400_is_never_retried() {
    let ch = channel_from(RETRYING);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, status(400), 5, &ch);
    assert!(f.is_done());
    assert_eq!(f.event_attempts(0), 1);
    assert_eq!(f.verdict(&ch).status, 500);
}

#[test]
fn retry_after_lengthens_the_wait_capped_by_the_maximum_and_never_shortens_it() {
    let ch = channel_from(RETRYING);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    let mut end = status(429);
    end.retry_after_ms = Some(30_000);
    f.completed(1, end, 0, &ch);
    assert_eq!(f.next_wakeup(), Some(1000), "30 s capped at backoff_max_ms");
    send_all(&mut f, 1000, &mut next);
    let mut end = status(503);
    end.retry_after_ms = Some(0);
    f.completed(2, end, 1000, &ch);
    assert_eq!(
        f.next_wakeup(),
        Some(1200),
        "linear: 200 ms before retry 2, not shortened by retry-after: 0"
    );
}

#[test]
fn a_refused_call_is_retried_too() {
    let ch = channel_from(RETRYING);
    let mut f = FanOut::new(1, 0);
    f.take_ready(0);
    f.dispatch_failed(0, dispatch_error("no such cluster"), 0, &ch);
    assert!(!f.is_done());
    assert_eq!(f.next_wakeup(), Some(100));
}

/// Subscriber 0's dead-letter target took the event: it counts as delivered, 202.
fn assert_dead_lettered_and_202(f: &FanOut, ch: &Channel) {
    assert!(f.is_done() && f.is_delivered(0));
    let answer = f.verdict(ch);
    assert_eq!(answer.status, 202);
    assert!(answer
        .headers
        .contains(&(DEAD_LETTERED_HEADER, "1".to_string())));
}

const DEAD_LETTER: &str = r#"{"delivery": {"retry": 1, "backoff_delay_ms": 10,
    "dead_letter": {"cluster": "dlq", "path": "/dead"}},
    "subscribers": [{"cluster": "a"}, {"cluster": "b"}]}"#;

#[test]
fn failed_for_good_goes_to_the_dead_letter_and_counts_as_delivered() {
    let ch = channel_from(DEAD_LETTER);
    let mut f = FanOut::new(2, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next); // a: 1, b: 2
    f.completed(2, CallEnd::ok(), 1, &ch);
    f.completed(1, status(503), 1, &ch);
    send_all(&mut f, 100, &mut next); // a retry: 3
    let mut end = status(502);
    if let Err(Failure::Status { detail, .. }) = &mut end.result {
        *detail = "bad  gateway".to_string();
    }
    end.body = b"bad\r\ngateway".to_vec();
    f.completed(3, end, 101, &ch);
    // Now the dead letter is ready at once.
    assert!(f.has_ready());
    let sends = send_all(&mut f, 101, &mut next); // dlq: 4
    assert_eq!(
        sends[0].0,
        ReadyCall {
            index: 0,
            leg: Leg::DeadLetter
        }
    );
    let letter = f.dead_letter(0, &ch, &Forwarded::default(), b"event");
    assert_eq!(letter.body, None);
    let header = |name: &str| letter.header(name);
    assert_eq!(header(DEAD_LETTER_CLUSTER), Some("a"));
    assert_eq!(header(DEAD_LETTER_LEG), Some("event"));
    assert_eq!(header(DEAD_LETTER_OUTCOME), Some("status"));
    assert_eq!(header(DEAD_LETTER_STATUS), Some("502"));
    assert_eq!(header(DEAD_LETTER_BODY), Some("bad  gateway"));
    assert_eq!(header(DEAD_LETTER_ATTEMPTS), Some("2"));
    assert_eq!(header("ce-knativeerrordest"), Some("http://a/"));
    assert_eq!(header("ce-knativeerrorcode"), Some("502"));
    // The raw answer of the last attempt, not the sanitized detail.
    assert_eq!(
        header("ce-knativeerrordata"),
        Some(
            base64::engine::general_purpose::STANDARD
                .encode("bad\r\ngateway")
                .as_str()
        )
    );
    f.completed(4, CallEnd::ok(), 102, &ch);
    assert_dead_lettered_and_202(&f, &ch);
}

#[test]
fn a_failing_dead_letter_is_a_failure_reporting_both() {
    let ch = channel_from(DEAD_LETTER);
    let mut f = FanOut::new(2, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(2, CallEnd::ok(), 1, &ch);
    f.completed(1, status(400), 1, &ch); // not retryable: straight to the dead letter
    send_all(&mut f, 1, &mut next); // dlq: 3
    f.completed(3, status(500), 2, &ch);
    send_all(&mut f, 100, &mut next); // dlq retry: 4
    f.completed(4, CallEnd::failed(Failure::NoResponse), 101, &ch);
    assert!(f.is_done());
    let doc = report(&f.verdict(&ch));
    let failed = &doc["failed"][0];
    assert_eq!(failed["cluster"], "a");
    assert_eq!(failed["leg"], "dead_letter");
    assert_eq!(failed["outcome"], "no_response");
    assert_eq!(failed["attempts"], 1);
    assert_eq!(failed["event"]["outcome"], "status");
    assert_eq!(failed["event"]["status"], 400);
}

const REPLY: &str = r#"{"subscribers": [{"cluster": "a", "reply": {"cluster": "r"}}]}"#;

#[test]
fn a_2xx_with_a_body_is_passed_to_the_reply_target() {
    let ch = channel_from(REPLY);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    let reply = ReplyEvent {
        headers: [("ce-type", "reply")].into_iter().collect(),
        body: b"answer".to_vec(),
    };
    f.completed(1, CallEnd::replied(reply.clone()), 1, &ch);
    assert!(!f.is_done());
    let sends = send_all(&mut f, 1, &mut next);
    assert_eq!(
        sends[0].0,
        ReadyCall {
            index: 0,
            leg: Leg::Reply
        }
    );
    assert_eq!(f.reply_event(0), Some(&reply));
    f.completed(2, CallEnd::ok(), 2, &ch);
    assert!(f.is_done());
    assert_eq!(f.verdict(&ch), Answer::accepted());
}

#[test]
fn a_2xx_without_a_reply_is_done_and_a_failed_reply_is_a_failed_delivery() {
    let ch = channel_from(REPLY);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, CallEnd::ok(), 1, &ch);
    assert!(f.is_done(), "no reply event means done");

    let mut f = FanOut::new(1, 0);
    send_all(&mut f, 0, &mut next);
    let reply = ReplyEvent {
        headers: [("ce-type", "t")].into_iter().collect(),
        body: b"x".to_vec(),
    };
    f.completed(next, CallEnd::replied(reply), 1, &ch);
    send_all(&mut f, 1, &mut next);
    f.completed(next, status(503), 2, &ch);
    assert!(f.is_done());
    let doc = report(&f.verdict(&ch));
    assert_eq!(doc["failed"][0]["leg"], "reply");
    assert_eq!(doc["failed"][0]["status"], 503);
}

#[test]
fn a_reply_event_without_data_is_passed_on_too() {
    let ch = channel_from(REPLY);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    let reply = ReplyEvent {
        headers: [("ce-type", "t")].into_iter().collect(),
        body: Vec::new(),
    };
    f.completed(1, CallEnd::replied(reply), 1, &ch);
    assert_eq!(f.take_ready(1)[0].leg, Leg::Reply);
}

/// A 2xx whose reply of 2000 bytes is over a limit of 1000.
fn too_large_reply() -> CallEnd {
    CallEnd {
        reply: Some(Err(Failure::TooLarge {
            size: 2000,
            limit: 1000,
        })),
        ..CallEnd::ok()
    }
}

#[test]
fn a_reply_too_large_is_a_failed_reply_never_sent() {
    let ch = channel_from(REPLY);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, too_large_reply(), 7, &ch);
    assert!(f.is_done(), "too large is not retried");
    assert!(
        f.take_ready(7).is_empty(),
        "nothing goes to the reply target"
    );
    let answer = f.verdict(&ch);
    assert_eq!(answer.status, 500);
    let failed = &report(&answer)["failed"][0];
    assert_eq!(failed["leg"], "reply");
    assert_eq!(failed["outcome"], "too_large");
    assert_eq!(
        failed["detail"],
        "the reply of 2000 bytes is larger than max_body_bytes (1000): not passed on"
    );
    assert_eq!(failed["attempts"], 1);
    assert_eq!(failed["elapsed_ms"], 7);
    assert!(failed.get("status").is_none());
}

const REPLY_AND_DEAD_LETTER: &str = r#"{"delivery": {"retry": 1, "backoff_delay_ms": 10,
    "dead_letter": {"cluster": "dlq"}},
    "subscribers": [{"cluster": "a", "authority": "a.local", "path": "/in",
                     "reply": {"cluster": "r", "authority": "r.local", "path": "/replies"}}]}"#;

#[test]
fn a_reply_that_failed_for_good_sends_the_original_event_to_the_dead_letter() {
    let ch = channel_from(REPLY_AND_DEAD_LETTER);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next); // a: 1
    let reply = ReplyEvent {
        headers: [("ce-type", "t")].into_iter().collect(),
        body: b"answer".to_vec(),
    };
    f.completed(1, CallEnd::replied(reply), 1, &ch);
    send_all(&mut f, 1, &mut next); // r: 2
    let mut end = status(503);
    end.body = b"replies down".to_vec();
    f.completed(2, end.clone(), 2, &ch);
    assert!(f.is_retrying(0), "the reply is retried like the event");
    send_all(&mut f, 100, &mut next); // r retry: 3
    f.completed(3, end, 101, &ch);
    assert!(!f.is_retrying(0) && !f.is_failed(0));
    let sends = send_all(&mut f, 101, &mut next); // dlq: 4
    assert_eq!(sends[0].0.leg, Leg::DeadLetter);
    let letter = f.dead_letter(0, &ch, &Forwarded::default(), b"event");
    let header = |name: &str| letter.header(name);
    assert_eq!(header(DEAD_LETTER_CLUSTER), Some("a"));
    assert_eq!(header(DEAD_LETTER_LEG), Some("reply"));
    assert_eq!(header(DEAD_LETTER_STATUS), Some("503"));
    assert_eq!(header(DEAD_LETTER_ATTEMPTS), Some("1"));
    assert_eq!(
        header("ce-knativeerrordest"),
        Some("http://r.local/replies"),
        "the reply target failed, not the subscriber"
    );
    assert_eq!(header("ce-knativeerrorcode"), Some("503"));
    f.completed(4, CallEnd::ok(), 102, &ch);
    assert_dead_lettered_and_202(&f, &ch);
}

#[test]
fn a_reply_too_large_goes_to_the_dead_letter_and_a_failing_one_reports_both() {
    let ch = channel_from(REPLY_AND_DEAD_LETTER);
    let mut f = FanOut::new(1, 0);
    let mut next = 0;
    send_all(&mut f, 0, &mut next);
    f.completed(1, too_large_reply(), 1, &ch);
    let sends = send_all(&mut f, 1, &mut next); // dlq: 2
    assert_eq!(sends[0].0.leg, Leg::DeadLetter);
    let letter = f.dead_letter(0, &ch, &Forwarded::default(), b"event");
    assert!(letter
        .headers
        .contains(&("ce-knativeerrorcode".to_string(), "413".to_string())));
    assert!(letter
        .headers
        .contains(&(DEAD_LETTER_OUTCOME.to_string(), "too_large".to_string())));
    f.completed(2, status(500), 2, &ch);
    send_all(&mut f, 100, &mut next); // dlq retry: 3
    f.completed(3, status(500), 101, &ch);
    assert!(f.is_done());
    let failed = &report(&f.verdict(&ch))["failed"][0];
    assert_eq!(failed["leg"], "dead_letter");
    assert_eq!(failed["status"], 500);
    assert_eq!(failed["reply"]["outcome"], "too_large");
    assert!(failed.get("event").is_none());
}
