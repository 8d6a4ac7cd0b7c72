//! What a worker still owes, and a plugin retired while it owes something: every kind of
//! owed work (an async delivery, a retry waiting for its backoff, a dead letter, a reply, a
//! best-effort call after the answer) is in `fanout.in_flight` until it ends, and a root
//! context with calls in flight is not deleted before they are answered.

use super::*;
use crate::deliveries::Owed;

/// Answers call `token` (made by the root) with 200 and these headers and body.
fn answer_root_ok(plugin: &mut FakeEnvoy, token: u32) {
    plugin.answer_root_call(token, Some(200), "", &[]);
}

#[test]
fn an_async_delivery_is_owed_from_its_202_until_every_call_ended() {
    let mut plugin = FakeEnvoy::configured(ASYNC);
    let _ctx = send(&plugin, &post("x"), b"e");
    assert_eq!(plugin.only_answer().status, 202);
    assert_eq!(plugin.root.owed().fanouts, 1);
    assert_eq!(plugin.root.owed().answered, 1);
    // The next tick sends both calls from the root; the gauge shows the fan-out.
    assert_eq!(plugin.flushed("fanout.in_flight"), 1);
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 2);
    assert!(calls.iter().all(|c| c.context == ROOT));
    assert_eq!(plugin.root.owed().calls, 2);
    answer_root_ok(&mut plugin, calls[0].token);
    assert_eq!(plugin.flushed("fanout.in_flight"), 1, "one call still open");
    answer_root_ok(&mut plugin, calls[1].token);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
    assert_eq!(plugin.root.owed(), Owed::default());
}

#[test]
fn a_retry_waiting_for_its_backoff_is_owed() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"mode": "async", "delivery": {"retry": 1, "backoff_policy": "linear",
            "backoff_delay_ms": 5000}, "subscribers": [{"cluster": "a"}]}"#,
    );
    let _ctx = send(&plugin, &post("x"), b"e");
    plugin.tick_at(10);
    let first = plugin.last_call();
    plugin.answer_root_call(first.token, Some(503), "busy", &[]);
    let owed = plugin.root.owed();
    assert_eq!(
        (owed.fanouts, owed.retrying, owed.calls),
        (1, 1, 0),
        "{owed}"
    );
    assert_eq!(
        plugin.flushed("fanout.in_flight"),
        1,
        "no call open, one owed"
    );
    plugin.tick_at(6000);
    let retry = plugin.last_call();
    assert_ne!(retry.token, first.token, "the retry went out");
    answer_root_ok(&mut plugin, retry.token);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
    assert_eq!(plugin.state().value("fanout.subscriber.a.delivered"), 1);
}

#[test]
fn a_dead_letter_is_owed_until_its_target_took_it() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"mode": "async", "delivery": {"dead_letter": {"cluster": "dlq"}},
            "subscribers": [{"cluster": "a"}]}"#,
    );
    let _ctx = send(&plugin, &post("x"), b"e");
    plugin.tick_at(10);
    let call = plugin.last_call();
    plugin.answer_root_call(call.token, Some(500), "down", &[]);
    let dead = plugin.last_call();
    assert_eq!(dead.cluster, "dlq");
    assert_eq!(plugin.flushed("fanout.in_flight"), 1);
    answer_root_ok(&mut plugin, dead.token);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
    assert_eq!(plugin.state().value("fanout.subscriber.a.dead_lettered"), 1);
}

#[test]
fn a_reply_is_owed_until_its_target_took_it() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"mode": "async", "subscribers": [{"cluster": "a",
            "reply": {"cluster": "replies"}}]}"#,
    );
    let _ctx = send(&plugin, &post("x"), b"e");
    plugin.tick_at(10);
    let call = plugin.last_call();
    plugin.answer_root_call(
        call.token,
        Some(200),
        "{}",
        &[
            (":status", "200"),
            ("ce-specversion", "1.0"),
            ("ce-id", "r-1"),
            ("ce-source", "/a"),
            ("ce-type", "com.example.reply"),
        ],
    );
    let reply = plugin.last_call();
    assert_eq!(reply.cluster, "replies");
    assert_eq!(plugin.flushed("fanout.in_flight"), 1);
    answer_root_ok(&mut plugin, reply.token);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
}

#[test]
fn a_best_effort_call_after_the_answer_is_owed() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"subscribers": [{"cluster": "a"}, {"cluster": "b", "required": false}]}"#,
    );
    let mut ctx = send(&plugin, &post("x"), b"e");
    let a = plugin.last_call();
    plugin.tick_at(10);
    let b = plugin.last_call();
    assert_eq!((b.cluster.as_str(), b.context), ("b", ROOT));
    plugin.answer_call(&mut ctx, a.token, Some(200), "");
    assert_eq!(plugin.only_answer().status, 202);
    assert!(ctx.on_done());
    assert_eq!(plugin.root.owed().answered, 1);
    assert_eq!(plugin.flushed("fanout.in_flight"), 1);
    answer_root_ok(&mut plugin, b.token);
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
}

#[test]
fn a_retired_root_with_calls_in_flight_waits_for_their_answers() {
    let mut plugin = FakeEnvoy::configured(ASYNC);
    let _ctx = send(&plugin, &post("x"), b"e");
    plugin.tick_at(10);
    let calls = plugin.state().dispatched.clone();
    assert_eq!(calls.len(), 2);
    assert!(!plugin.root.on_done(), "deleted with its calls in flight");
    assert!(!plugin.root.take_retired());
    answer_root_ok(&mut plugin, calls[0].token);
    assert!(!plugin.root.take_retired(), "one call still in flight");
    answer_root_ok(&mut plugin, calls[1].token);
    assert!(plugin.root.take_retired());
    assert!(!plugin.root.take_retired(), "done is told once");
    assert_eq!(plugin.flushed("fanout.in_flight"), 0);
}

#[test]
fn a_root_retired_owing_nothing_goes_at_once() {
    let mut plugin = FakeEnvoy::configured(ASYNC);
    assert!(plugin.root.on_done());
    assert!(
        !plugin.root.take_retired(),
        "nothing to tell: on_done said true"
    );
}

#[test]
fn the_last_root_retired_finishes_what_is_owed_retries_included() {
    let mut plugin = FakeEnvoy::configured(
        r#"{"mode": "async", "delivery": {"retry": 1, "backoff_policy": "linear",
            "backoff_delay_ms": 100}, "subscribers": [{"cluster": "a"}]}"#,
    );
    let _ctx = send(&plugin, &post("x"), b"e");
    plugin.tick_at(10);
    assert!(!plugin.root.on_done());
    plugin.answer_root_call(plugin.last_call().token, Some(503), "", &[]);
    assert!(
        !plugin.root.take_retired(),
        "no call in flight, but a retry owed and nobody after it to send it"
    );
    plugin.tick_at(200);
    let retry = plugin.last_call();
    assert_eq!(
        plugin.state().dispatched.len(),
        2,
        "the retired root sent the retry"
    );
    answer_root_ok(&mut plugin, retry.token);
    assert!(plugin.root.take_retired());
    assert_eq!(plugin.flushed("fanout.subscriber.a.delivered"), 1);
}

/// A configuration update: the old root waits for its own calls only, sends nothing new
/// while the new root's timer runs, and the new root carries the VM's deliveries on.
#[test]
fn an_old_root_waits_for_its_own_calls_while_the_new_root_sends() {
    let host = FakeHost::default();
    host.0.borrow_mut().config = Some(ASYNC.as_bytes().to_vec());
    let shared = VmShared::default();
    let mut old = Plugin::with_shared(ROOT, host.clone(), shared.clone());
    assert!(old.on_configure());
    let request = |plugin: &Plugin<FakeHost>, stream: u32| {
        host.0.borrow_mut().request_headers = post("x")
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        host.0.borrow_mut().request_body = b"e".to_vec();
        host.0.borrow_mut().effective = stream;
        let mut ctx = plugin.create_stream(stream);
        ctx.on_request_headers(false);
        ctx.on_request_body(1, true);
        assert!(ctx.on_done());
    };
    let tick = |plugin: &mut Plugin<FakeHost>, id: u32, now: u64| {
        host.0.borrow_mut().now_ms = now;
        host.0.borrow_mut().effective = id;
        plugin.on_tick();
    };
    request(&old, 100);
    tick(&mut old, ROOT, 10);
    let old_calls: Vec<u32> = host.0.borrow().dispatched.iter().map(|d| d.token).collect();
    assert_eq!(old_calls.len(), 2);

    let new_root = ROOT + 10;
    let mut new = Plugin::with_shared(new_root, host.clone(), shared);
    assert!(new.on_configure());
    assert!(!old.on_done(), "the old root's calls are in flight");
    request(&new, 101);
    tick(&mut old, ROOT, 20);
    assert_eq!(
        host.0.borrow().dispatched.len(),
        2,
        "the retired root sent new calls"
    );
    tick(&mut new, new_root, 30);
    let sent: Vec<(u32, u32)> = host.0.borrow().dispatched[2..]
        .iter()
        .map(|d| (d.token, d.context))
        .collect();
    assert_eq!(sent.len(), 2);
    assert!(sent.iter().all(|(_, context)| *context == new_root));
    for token in old_calls {
        host.0.borrow_mut().call_response = (Some(200), Vec::new());
        host.0.borrow_mut().effective = ROOT;
        old.on_call_response(token, 1, 0);
    }
    assert!(old.take_retired(), "its own calls were answered");
    assert!(
        !new.take_retired(),
        "the new root is not retired, whatever it owes"
    );
    assert_eq!(new.owed().fanouts, 1);
}
