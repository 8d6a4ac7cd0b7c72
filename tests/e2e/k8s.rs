//! fanout on a real Kubernetes API (`make test-k8s`): the kube-apiserver of
//! `KUBE_APISERVER_BIN` on etcd, `fanout-control --source kubernetes`, real Envoys on the
//! shipped `envoy/xds/envoy.yaml`, objects applied with `kubectl`; the `knative_` tests add
//! Knative Eventing's own controller (`KNATIVE_CONTROLLER_BIN`, `KNATIVE_EVENTING_SRC`).
//! Ignored in `make test` (they need those binaries); `make test-k8s` runs them, or says
//! SKIPPED and what is missing.

use crate::harness::control::{xds_envoy, Control};
use crate::harness::kube::{Knative, KubeApi};
use crate::harness::{free_ports, manifest_dir, Client, Envoy, Subscriber};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);
const NS: &str = "shop";

/// The apiserver with the shipped FanoutChannel CRD (and ClusterRoles) applied and
/// established, and namespace `shop`.
fn cluster() -> KubeApi {
    let api = KubeApi::start();
    let crd = manifest_dir().join("deploy/kubernetes/fanoutchannel.yaml");
    api.run(&["apply", "-f", crd.to_str().unwrap()]);
    api.run(&[
        "wait",
        "--for=condition=established",
        "--timeout=30s",
        "crd/fanoutchannels.messaging.fanout.dev",
    ]);
    api.run(&["create", "namespace", NS]);
    api
}

fn host(channel: &str) -> String {
    format!("{channel}-kn-channel.{NS}.svc.cluster.local")
}

/// A FanoutChannel with these subscriber URIs (uids `<name>-<i>`, generation 1).
fn fanout_channel(name: &str, uris: &[String]) -> String {
    let subscribers: Vec<String> = uris
        .iter()
        .enumerate()
        .map(|(i, uri)| format!("  - {{uid: {name}-{i}, generation: 1, subscriberUri: '{uri}'}}"))
        .collect();
    let spec = if subscribers.is_empty() {
        "spec: {}".to_owned()
    } else {
        format!("spec:\n  subscribers:\n{}", subscribers.join("\n"))
    };
    format!(
        "apiVersion: messaging.fanout.dev/v1alpha1\nkind: FanoutChannel\nmetadata: {{name: \
         {name}, namespace: {NS}}}\n{spec}\n"
    )
}

fn uri(subscriber: &Subscriber) -> String {
    format!("http://127.0.0.1:{}/", subscriber.port())
}

/// A sender posting to `host` through `envoy` every 10 ms from the moment it starts, as a
/// client of the channel does; stops on drop.
struct Sender {
    stop: Arc<AtomicBool>,
}

impl Sender {
    fn start(host: &str, envoy: &Envoy) -> Sender {
        let stop = Arc::new(AtomicBool::new(false));
        let client = Client::http1_resolving(host, envoy.addr());
        let url = format!("http://{host}:{}/", envoy.port());
        let flag = stop.clone();
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !flag.load(Ordering::SeqCst) {
                n += 1;
                let _ = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("ce-specversion", "1.0")
                    .header("ce-type", "order.created")
                    .header("ce-source", "k8s-test")
                    .header("ce-id", format!("e{n}"))
                    .body(format!("{{\"n\":{n}}}"))
                    .send();
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Sender { stop }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// From `start` to the first event `subscriber` got after it (bounded by [`WAIT`]).
fn first_delivery(subscriber: &Subscriber, start: Instant, what: &str) -> Duration {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(r) = subscriber.requests().iter().find(|r| r.at >= start) {
            return r.at.saturating_duration_since(start);
        }
        assert!(
            Instant::now() < deadline,
            "{what}: no event within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `subscriber` got no event after `since` for `quiet`.
fn silent_since(subscriber: &Subscriber, since: Instant) -> bool {
    subscriber.requests().iter().all(|r| r.at < since)
}

/// The server's state of channel `shop/<name>`.
fn channel_state(control: &Control, name: &str) -> Value {
    control.state()["channels"][format!("{NS}/{name}")].clone()
}

#[test]
#[ignore = "needs KUBE_APISERVER_BIN: make test-k8s"]
fn a_fanout_channel_applied_with_kubectl_is_served_changed_and_deleted() {
    let api = cluster();
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    let _sender = Sender::start(&host("orders"), &envoy);

    let applied = Instant::now();
    api.apply(&fanout_channel("orders", &[uri(&a)]));
    let took = first_delivery(&a, applied, "a after the channel was applied");
    eprintln!("k8s: apply to first delivery (FanoutChannel, no Knative): {took:?}");

    // A second subscriber: served; the first keeps getting events.
    let applied = Instant::now();
    api.apply(&fanout_channel("orders", &[uri(&a), uri(&b)]));
    first_delivery(&b, applied, "b after it was added");
    first_delivery(&a, Instant::now(), "a after b was added");

    // Deleted: nobody gets events any more (Envoy answers 404 for the host).
    api.run(&["delete", "fanoutchannel", "orders", "-n", NS]);
    control.wait_for_state("the channel gone", WAIT, |s| {
        s["channels"].get(format!("{NS}/orders")).is_none()
    });
    let settled = Instant::now() + Duration::from_millis(500);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(silent_since(&a, settled) && silent_since(&b, settled));
}

#[test]
#[ignore = "needs KUBE_APISERVER_BIN: make test-k8s"]
fn the_watch_resumes_after_a_kube_apiserver_restart_and_serves_what_came_after() {
    let mut api = cluster();
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    api.apply(&fanout_channel("orders", &[uri(&a)]));
    let _orders = Sender::start(&host("orders"), &envoy);
    first_delivery(&a, Instant::now(), "a before the restart");

    assert_eq!(relists(&control), 0, "relisted before the restart");

    api.restart();
    // Served all along from the last whole list.
    first_delivery(&a, Instant::now(), "a right after the restart");
    let applied = Instant::now();
    api.apply(&fanout_channel("returns", &[uri(&b)]));
    let _returns = Sender::start(&host("returns"), &envoy);
    let took = first_delivery(&b, applied, "a channel made after the restart");
    eprintln!("k8s: apply to first delivery after an apiserver restart: {took:?}");
    assert!(channel_state(&control, "orders").is_object());
    // Every kind was listed again, and counted.
    let relisted = relists(&control);
    assert!(relisted >= 1, "{relisted} relists counted");
}

#[test]
#[ignore = "needs KUBE_APISERVER_BIN: make test-k8s"]
fn without_knatives_crds_fanout_channels_are_served_and_the_missing_kinds_logged() {
    // No Knative CRD is installed: the server is ready on FanoutChannels alone.
    let api = cluster();
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let log = control.log();
    for kind in [
        "inmemorychannels",
        "channels",
        "subscriptions",
        "eventpolicies",
    ] {
        assert!(
            log.contains(&format!("{kind}.")) && log.contains("not served by the API"),
            "{kind}: {log}"
        );
    }
    let envoy = xds_envoy("k1", control.xds_port).start();
    let a = Subscriber::ok("a");
    let _sender = Sender::start(&host("orders"), &envoy);
    api.apply(&fanout_channel("orders", &[uri(&a)]));
    first_delivery(&a, Instant::now() - Duration::from_secs(60), "a");
}

/// `status.subscribers[]` entry of `uid`.
fn subscriber_status(channel: &Value, uid: &str) -> Value {
    channel["status"]["subscribers"]
        .as_array()
        .and_then(|s| s.iter().find(|e| e["uid"] == uid).cloned())
        .unwrap_or(Value::Null)
}

fn condition(object: &Value, type_: &str) -> Value {
    object["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|e| e["type"] == type_).cloned())
        .unwrap_or(Value::Null)
}

#[test]
#[ignore = "needs KUBE_APISERVER_BIN: make test-k8s"]
fn a_fanout_channels_status_follows_what_the_envoys_acked() {
    let api = cluster();
    let control = Control::start_kubernetes(
        &api.kubeconfig,
        free_ports(1)[0],
        &["--dispatcher-service", "fanout/fanout-envoy"],
    );
    let envoy = xds_envoy("k1", control.xds_port).start();
    let a = Subscriber::ok("a");
    let _sender = Sender::start(&host("orders"), &envoy);
    api.apply(&fanout_channel("orders", &[uri(&a)]));
    let id = ("fanoutchannel", NS, "orders");
    let channel = api.wait_for(id, "subscriber ready", WAIT, |c| {
        subscriber_status(c, "orders-0")["ready"] == "True"
    });
    let ready_seen = Instant::now();
    assert!(a.count() > 0, "Ready before a delivery");
    assert_eq!(
        subscriber_status(&channel, "orders-0")["observedGeneration"],
        1
    );
    assert_eq!(
        condition(&channel, "Ready")["status"],
        "True",
        "{channel:#}"
    );
    assert_eq!(condition(&channel, "DispatcherReady")["status"], "True");
    assert_eq!(
        channel["status"]["address"]["url"],
        format!("http://{}", host("orders"))
    );
    assert_eq!(
        channel["status"]["observedGeneration"],
        channel["metadata"]["generation"]
    );
    // /state agrees within a second of the status.
    control.wait_for_state("live_on agrees", Duration::from_secs(1), |s| {
        s["channels"][format!("{NS}/orders")]["subscribers"][0]["live_on"]
            == serde_json::json!(["k1"])
    });
    eprintln!(
        "k8s: /state agreed {:?} after Ready was seen",
        ready_seen.elapsed()
    );
    // Knative's annotation, and the channel's Service, owned by it.
    api.wait_for(id, "annotated", WAIT, |c| {
        c["metadata"]["annotations"]["messaging.knative.dev/subscribable"] == "v1"
    });
    let service = api.wait_for(
        ("service", NS, "orders-kn-channel"),
        "created",
        WAIT,
        |_| true,
    );
    assert_eq!(service["spec"]["type"], "ExternalName");
    assert_eq!(
        service["spec"]["externalName"],
        "fanout-envoy.fanout.svc.cluster.local"
    );
    assert_eq!(
        service["metadata"]["ownerReferences"][0]["uid"],
        channel["metadata"]["uid"]
    );

    // A subscriber fanout cannot call: False with the reason; the first keeps its events.
    let bad = "ftp://files.example/drop".to_owned();
    api.apply(&fanout_channel("orders", &[uri(&a), bad]));
    let channel = api.wait_for(id, "the bad subscriber False", WAIT, |c| {
        subscriber_status(c, "orders-1")["ready"] == "False"
    });
    let message = subscriber_status(&channel, "orders-1")["message"].to_string();
    assert!(message.contains("spec.subscribers[1]"), "{message}");
    assert_eq!(condition(&channel, "Ready")["status"], "False");
    first_delivery(
        &a,
        Instant::now(),
        "a while the channel has a bad subscriber",
    );

    // Removed: its entry is pruned, and the channel is Ready again.
    api.apply(&fanout_channel("orders", &[uri(&a)]));
    let channel = api.wait_for(id, "Ready again", WAIT, |c| {
        condition(c, "Ready")["status"] == "True"
    });
    assert_eq!(
        channel["status"]["subscribers"].as_array().map(Vec::len),
        Some(1),
        "{channel:#}"
    );
}

/// A Subscription `name` to `channel` (`kind` FanoutChannel or Channel) calling `uri`.
fn subscription(name: &str, (api_version, kind, channel): (&str, &str, &str), uri: &str) -> String {
    format!(
        "apiVersion: messaging.knative.dev/v1\nkind: Subscription\nmetadata: {{name: {name}, \
         namespace: {NS}}}\nspec:\n  channel: {{apiVersion: {api_version}, kind: {kind}, name: \
         {channel}}}\n  subscriber: {{uri: '{uri}'}}\n"
    )
}

const FANOUT: (&str, &str, &str) = ("messaging.fanout.dev/v1alpha1", "FanoutChannel", "orders");

fn is_ready(object: &Value) -> bool {
    condition(object, "Ready")["status"] == "True"
        && object["status"]["observedGeneration"] == object["metadata"]["generation"]
}

/// The channel's own entry for the Subscription is ready at its generation.
fn channel_acknowledged(api: &KubeApi, channel: &str, sub: &Value) -> Value {
    let (uid, generation) = (
        sub["metadata"]["uid"].clone(),
        sub["metadata"]["generation"].clone(),
    );
    api.wait_for(
        ("fanoutchannel", NS, channel),
        "its entry ready",
        WAIT,
        |c| {
            let entry = subscriber_status(c, uid.as_str().unwrap_or_default());
            entry["ready"] == "True" && entry["observedGeneration"] == generation
        },
    )
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// With Knative's controller: Subscriptions applied one after another turn Ready and are
/// delivered (apply-to-Ready and apply-to-first-delivery, p50 and p99); one edited to
/// another subscriber moves there; one deleted gets nothing more.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_subscriptions_turn_ready_are_delivered_edited_and_deleted() {
    let api = cluster();
    let knative = Knative::start(&api);
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    api.apply(&fanout_channel("orders", &[]));
    let _sender = Sender::start(&host("orders"), &envoy);
    let subscribers: Vec<Subscriber> = (0..10).map(|i| Subscriber::ok(&format!("s{i}"))).collect();
    let (mut delivered, mut ready) = (Vec::new(), Vec::new());
    for (i, s) in subscribers.iter().enumerate() {
        let applied = Instant::now();
        api.apply(&subscription(&format!("s{i}"), FANOUT, &uri(s)));
        let what = format!("Subscription s{i}\n{}", knative.log());
        delivered.push(first_delivery(s, applied, &what));
        api.wait_for(
            ("subscription", NS, &format!("s{i}")),
            "Ready",
            WAIT,
            is_ready,
        );
        ready.push(applied.elapsed());
    }
    delivered.sort();
    ready.sort();
    eprintln!(
        "k8s: Subscription apply to first delivery (Knative's controller, {} samples): p50 {:?} \
         p99 {:?}; apply to Ready (polled every 50 ms with kubectl): p50 {:?} p99 {:?}",
        delivered.len(),
        percentile(&delivered, 0.5),
        percentile(&delivered, 0.99),
        percentile(&ready, 0.5),
        percentile(&ready, 0.99)
    );

    // Edited: s0 now calls x; the channel acknowledges the new generation; x gets events,
    // s0's old subscriber none after that.
    let x = Subscriber::ok("x");
    api.apply(&subscription("s0", FANOUT, &uri(&x)));
    let sub = api.wait_for(("subscription", NS, "s0"), "generation 2", WAIT, |s| {
        s["metadata"]["generation"] == 2
    });
    channel_acknowledged(&api, "orders", &sub);
    // /state agrees within a second: the Envoy's clusters still hold s0's old one (kept for
    // the cluster grace), and x is live on it all the same.
    control.wait_for_state("x live on k1", Duration::from_secs(1), |s| {
        s["channels"][format!("{NS}/orders")]["subscribers"]
            .as_array()
            .is_some_and(|subs| {
                subs.iter()
                    .any(|e| e["uri"] == uri(&x) && e["live_on"] == serde_json::json!(["k1"]))
            })
    });
    first_delivery(&x, Instant::now(), "x after s0 was edited");
    let settled = Instant::now() + Duration::from_millis(500);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        silent_since(&subscribers[0], settled),
        "s0's old subscriber still called"
    );

    // Deleted: s1's entry leaves the channel's spec and status; s1 gets nothing more.
    let uid = api.get("subscription", NS, "s1").unwrap()["metadata"]["uid"].clone();
    api.run(&["delete", "subscription", "s1", "-n", NS]);
    api.wait_for(("fanoutchannel", NS, "orders"), "s1 pruned", WAIT, |c| {
        subscriber_status(c, uid.as_str().unwrap()).is_null()
            && !c["spec"].to_string().contains(uid.as_str().unwrap())
    });
    let settled = Instant::now() + Duration::from_millis(500);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        silent_since(&subscribers[1], settled),
        "s1 still called after its deletion"
    );
    first_delivery(&subscribers[2], Instant::now(), "s2 after s1 was deleted");
}

/// A Knative Channel whose template is a FanoutChannel: Knative creates the FanoutChannel,
/// copies its address and readiness back, and a Subscription to the Channel is served.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_a_channel_with_a_fanout_channel_template() {
    let api = cluster();
    let _knative = Knative::start(&api);
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    api.apply(&format!(
        "apiVersion: messaging.knative.dev/v1\nkind: Channel\nmetadata: {{name: events, \
         namespace: {NS}}}\nspec:\n  channelTemplate: {{apiVersion: \
         messaging.fanout.dev/v1alpha1, kind: FanoutChannel}}\n"
    ));
    let channel = api.wait_for(
        ("channels.messaging.knative.dev", NS, "events"),
        "Ready",
        WAIT,
        is_ready,
    );
    assert_eq!(
        channel["status"]["address"]["url"],
        format!("http://{}", host("events"))
    );
    let backing = api
        .get("fanoutchannel", NS, "events")
        .expect("the FanoutChannel Knative made");
    assert_eq!(backing["metadata"]["ownerReferences"][0]["kind"], "Channel");
    let a = Subscriber::ok("a");
    let _sender = Sender::start(&host("events"), &envoy);
    let applied = Instant::now();
    api.apply(&subscription(
        "a",
        ("messaging.knative.dev/v1", "Channel", "events"),
        &uri(&a),
    ));
    let took = first_delivery(&a, applied, "a, subscribed to the Channel");
    api.wait_for(("subscription", NS, "a"), "Ready", WAIT, is_ready);
    eprintln!(
        "k8s: apply to first delivery through a Channel with a FanoutChannel template: {took:?}"
    );
}

/// A channel's dead-letter sink: published in its status, Knative passes it to the
/// subscriber, and a failing subscriber's events land there.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_a_dead_letter_sink_gets_a_failing_subscribers_events() {
    let api = cluster();
    let _knative = Knative::start(&api);
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    let dls = Subscriber::ok("dls");
    let failing = Subscriber::start("failing", crate::harness::Behavior::respond(500, &[], ""));
    api.apply(&format!(
        "apiVersion: messaging.fanout.dev/v1alpha1\nkind: FanoutChannel\nmetadata: {{name: \
         orders, namespace: {NS}}}\nspec:\n  delivery:\n    deadLetterSink: {{uri: '{}'}}\n",
        uri(&dls)
    ));
    api.wait_for(
        ("fanoutchannel", NS, "orders"),
        "dead-letter sink published",
        WAIT,
        |c| c["status"]["deadLetterSinkUri"] == uri(&dls),
    );
    api.apply(&subscription("failing", FANOUT, &uri(&failing)));
    api.wait_for(("subscription", NS, "failing"), "Ready", WAIT, is_ready);
    let _sender = Sender::start(&host("orders"), &envoy);
    first_delivery(&failing, Instant::now(), "the failing subscriber is called");
    first_delivery(
        &dls,
        Instant::now(),
        "its events land in the dead-letter sink",
    );
}

/// fanout-control killed and started again: the Envoys keep delivering meanwhile, and the
/// Subscriptions stay Ready (no status flaps: no replica writes until it holds the Lease,
/// and by then the Envoys are back).
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_fanout_control_restarted_statuses_hold_and_events_flow() {
    let api = cluster();
    let _knative = Knative::start(&api);
    let xds_port = free_ports(1)[0];
    let mut control = Control::start_kubernetes(&api.kubeconfig, xds_port, &[]);
    let envoy = xds_envoy("k1", xds_port).start();
    api.apply(&fanout_channel("orders", &[]));
    let a = Subscriber::ok("a");
    api.apply(&subscription("a", FANOUT, &uri(&a)));
    let before = api.wait_for(("subscription", NS, "a"), "Ready", WAIT, is_ready);
    let _sender = Sender::start(&host("orders"), &envoy);
    first_delivery(&a, Instant::now(), "a");
    control.stop();
    first_delivery(&a, Instant::now(), "a while fanout-control is down");
    let _control = Control::start_kubernetes(&api.kubeconfig, xds_port, &[]);
    // Over the Lease's duration and more, the Subscription never leaves Ready.
    let until = Instant::now() + Duration::from_secs(15);
    while Instant::now() < until {
        let now = api.get("subscription", NS, "a").unwrap();
        assert!(is_ready(&now), "flapped: {now:#}");
        let channel = api.get("fanoutchannel", NS, "orders").unwrap();
        assert_eq!(
            condition(&channel, "Ready")["status"],
            "True",
            "{channel:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let after = api.get("subscription", NS, "a").unwrap();
    assert_eq!(
        condition(&after, "Ready")["lastTransitionTime"],
        condition(&before, "Ready")["lastTransitionTime"]
    );
    first_delivery(&a, Instant::now(), "a after the restart");
    // A new Subscription is served and turns Ready.
    let b = Subscriber::ok("b");
    api.apply(&subscription("b", FANOUT, &uri(&b)));
    first_delivery(&b, Instant::now(), "b after the restart");
    api.wait_for(("subscription", NS, "b"), "Ready", WAIT, is_ready);
}

/// Two replicas: only the Lease's holder writes (the status does not change while nothing
/// does); the holder killed, the other writes within the Lease's duration.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_two_replicas_one_writer_and_the_leader_killed() {
    let api = cluster();
    let _knative = Knative::start(&api);
    let ports = free_ports(2);
    let mut replicas = [
        Control::start_kubernetes(&api.kubeconfig, ports[0], &[]),
        Control::start_kubernetes(&api.kubeconfig, ports[1], &[]),
    ];
    let envoys = [
        xds_envoy("k1", ports[0]).start(),
        xds_envoy("k2", ports[1]).start(),
    ];
    api.apply(&fanout_channel("orders", &[]));
    let a = Subscriber::ok("a");
    api.apply(&subscription("a", FANOUT, &uri(&a)));
    api.wait_for(("subscription", NS, "a"), "Ready", WAIT, is_ready);
    // Quiet: the channel is not rewritten by the replicas in turn.
    let channel = api.get("fanoutchannel", NS, "orders").unwrap();
    std::thread::sleep(Duration::from_secs(5));
    let later = api.get("fanoutchannel", NS, "orders").unwrap();
    assert_eq!(
        channel["metadata"]["resourceVersion"], later["metadata"]["resourceVersion"],
        "the status was rewritten while nothing changed"
    );
    let lease = api.get("lease", "default", "fanout-control").unwrap();
    let holder = lease["spec"]["holderIdentity"].as_str().unwrap().to_owned();
    let leader = replicas
        .iter()
        .position(|r| holder.ends_with(&format!("-{}", r.pid())))
        .unwrap_or_else(|| panic!("no replica is the holder {holder}"));
    let killed = Instant::now();
    replicas[leader].stop();
    let b = Subscriber::ok("b");
    api.apply(&subscription("b", FANOUT, &uri(&b)));
    let _sender = Sender::start(&host("orders"), &envoys[1 - leader]);
    first_delivery(&b, killed, "b through the other replica's Envoy");
    api.wait_for(
        ("subscription", NS, "b"),
        "Ready after the leader was killed",
        WAIT,
        is_ready,
    );
    eprintln!(
        "k8s: leader killed -> the other replica's status for a new Subscription: {:?}",
        killed.elapsed()
    );
    let lease = api.get("lease", "default", "fanout-control").unwrap();
    assert_ne!(lease["spec"]["holderIdentity"], holder);
    assert!(
        killed.elapsed() < Duration::from_secs(25),
        "{:?}",
        killed.elapsed()
    );
}

/// The kube-apiserver restarted under Knative's controller and fanout-control: both watch
/// again, and a Subscription made after the restart is delivered and turns Ready.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_a_subscription_made_after_a_kube_apiserver_restart_turns_ready() {
    let mut api = cluster();
    let _knative = Knative::start(&api);
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    api.apply(&fanout_channel("orders", &[]));
    let a = Subscriber::ok("a");
    api.apply(&subscription("a", FANOUT, &uri(&a)));
    api.wait_for(("subscription", NS, "a"), "Ready", WAIT, is_ready);
    let _sender = Sender::start(&host("orders"), &envoy);
    first_delivery(&a, Instant::now(), "a before the restart");
    api.restart();
    first_delivery(&a, Instant::now(), "a right after the restart");
    let b = Subscriber::ok("b");
    let applied = Instant::now();
    api.apply(&subscription("b", FANOUT, &uri(&b)));
    let took = first_delivery(&b, applied, "b, made after the restart");
    api.wait_for(("subscription", NS, "b"), "Ready", WAIT, is_ready);
    eprintln!(
        "k8s: a Subscription made after an apiserver restart: first delivery {took:?}, Ready {:?}",
        applied.elapsed()
    );
}

/// A Subscription whose subscriber fanout cannot call (an ftp URI): the channel's entry for
/// it is False with fanout's words, and Knative's Subscription says so too; the channel's
/// other Subscription stays Ready all along (on the channel and in Knative) and keeps
/// getting events; the bad one deleted, the channel is Ready again.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_a_subscriber_fanout_cannot_call_is_false_and_the_others_stay_ready() {
    let api = cluster();
    let _knative = Knative::start(&api);
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    api.apply(&fanout_channel("orders", &[]));
    let a = Subscriber::ok("a");
    api.apply(&subscription("a", FANOUT, &uri(&a)));
    let sub_a = api.wait_for(("subscription", NS, "a"), "Ready", WAIT, is_ready);
    channel_acknowledged(&api, "orders", &sub_a);
    let a_uid = sub_a["metadata"]["uid"].as_str().unwrap().to_owned();
    let _sender = Sender::start(&host("orders"), &envoy);
    first_delivery(&a, Instant::now(), "a");

    let bad_uri = "ftp://files.example/drop";
    api.apply(&subscription("bad", FANOUT, bad_uri));
    // Until the bad one is False on the channel and in Knative, and 3 s more, a stays Ready.
    let deadline = Instant::now() + WAIT;
    let mut false_since: Option<Instant> = None;
    let (channel, bad) = loop {
        let channel = api.get("fanoutchannel", NS, "orders").unwrap();
        assert_eq!(
            subscriber_status(&channel, &a_uid)["ready"],
            "True",
            "a's entry left True: {channel:#}"
        );
        let sub = api.get("subscription", NS, "a").unwrap();
        assert!(is_ready(&sub), "a's Subscription left Ready: {sub:#}");
        let bad = api.get("subscription", NS, "bad").unwrap();
        let bad_uid = bad["metadata"]["uid"].as_str().unwrap_or_default();
        let entry = subscriber_status(&channel, bad_uid);
        let is_false = entry["ready"] == "False"
            && entry["observedGeneration"] == bad["metadata"]["generation"]
            && condition(&bad, "Ready")["status"] == "False";
        if !is_false {
            false_since = None;
        } else if false_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(3) {
            break (channel, bad);
        }
        assert!(
            Instant::now() < deadline,
            "the bad subscriber not False within {WAIT:?}: {channel:#}\n{bad:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let entry = subscriber_status(&channel, bad["metadata"]["uid"].as_str().unwrap());
    let message = entry["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("subscriberUri") && message.contains(bad_uri),
        "{message}"
    );
    let knative_says = condition(&bad, "Ready");
    assert_eq!(knative_says["status"], "False", "{bad:#}");
    first_delivery(
        &a,
        Instant::now(),
        "a while the bad subscriber is on the channel",
    );

    api.run(&["delete", "subscription", "bad", "-n", NS]);
    api.wait_for(("fanoutchannel", NS, "orders"), "Ready again", WAIT, |c| {
        condition(c, "Ready")["status"] == "True" && subscriber_status(c, &a_uid)["ready"] == "True"
    });
    first_delivery(&a, Instant::now(), "a after the bad subscriber was deleted");
}

/// A process stopped with SIGSTOP (its sockets stay open, it answers nothing) until drop.
struct Paused(libc::pid_t);

impl Paused {
    fn new(pid: u32) -> Paused {
        let pid = pid as libc::pid_t;
        // SAFETY: signalling a process this test started.
        unsafe {
            libc::kill(pid, libc::SIGSTOP);
        }
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe {
            libc::kill(self.0, libc::SIGCONT);
        }
    }
}

/// The replica holding the Lease, by pid.
fn leader(api: &KubeApi, replicas: &[Control]) -> usize {
    let lease = api.wait_for(("lease", "default", "fanout-control"), "held", WAIT, |l| {
        l["spec"]["holderIdentity"].is_string()
    });
    let holder = lease["spec"]["holderIdentity"].as_str().unwrap().to_owned();
    replicas
        .iter()
        .position(|r| holder.ends_with(&format!("-{}", r.pid())))
        .unwrap_or_else(|| panic!("no replica is the holder {holder}"))
}

/// Two replicas with an Envoy each: a subscriber turns Ready only once the Envoys of both
/// call it. The other replica's Envoy stopped (still connected, ACKing nothing), a new
/// subscriber is delivered through the holder's Envoy but stays not Ready (while the first
/// stays Ready); resumed, it turns Ready and is delivered through both.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN: make test-k8s"]
fn two_replicas_a_subscriber_is_ready_once_the_envoys_of_both_call_it() {
    let api = cluster();
    let ports = free_ports(2);
    let replicas = [
        Control::start_kubernetes(&api.kubeconfig, ports[0], &[]),
        Control::start_kubernetes(&api.kubeconfig, ports[1], &[]),
    ];
    let envoys = [
        xds_envoy("k1", ports[0]).start(),
        xds_envoy("k2", ports[1]).start(),
    ];
    let (a, b) = (Subscriber::ok("a"), Subscriber::ok("b"));
    api.apply(&fanout_channel("orders", &[uri(&a)]));
    let id = ("fanoutchannel", NS, "orders");
    api.wait_for(id, "a Ready", WAIT, |c| {
        subscriber_status(c, "orders-0")["ready"] == "True"
    });
    let leader = leader(&api, &replicas);
    let other = 1 - leader;

    let paused = Paused::new(envoys[other].pid());
    let applied = Instant::now();
    api.apply(&fanout_channel("orders", &[uri(&a), uri(&b)]));
    let _sender = Sender::start(&host("orders"), &envoys[leader]);
    first_delivery(&b, applied, "b through the holder's Envoy");
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let channel = api.get("fanoutchannel", NS, "orders").unwrap();
        assert_ne!(
            subscriber_status(&channel, "orders-1")["ready"],
            "True",
            "Ready while the other replica's Envoy does not call it: {channel:#}"
        );
        assert_eq!(
            subscriber_status(&channel, "orders-0")["ready"],
            "True",
            "{channel:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let channel = api.get("fanoutchannel", NS, "orders").unwrap();
    assert_eq!(
        condition(&channel, "DispatcherReady")["reason"],
        "EnvoysBehind",
        "{channel:#}"
    );

    drop(paused);
    let resumed = Instant::now();
    api.wait_for(id, "b Ready once both Envoys call it", WAIT, |c| {
        subscriber_status(c, "orders-1")["ready"] == "True"
    });
    eprintln!(
        "k8s: the other replica's Envoy resumed -> Ready on the holder's status: {:?}",
        resumed.elapsed()
    );
    let _other = Sender::start(&host("orders"), &envoys[other]);
    first_delivery(&b, Instant::now(), "b through the other replica's Envoy");
    // Each replica has its report, in the Lease's namespace.
    let reports = api.run(&[
        "get",
        "configmaps",
        "-n",
        "default",
        "-l",
        "messaging.fanout.dev/replica-report=true",
        "-o",
        "name",
    ]);
    assert_eq!(reports.lines().count(), 2, "{reports}");
}

/// `fanout_control_source_relists_total` on the state address.
fn relists(control: &Control) -> u64 {
    let (code, text) = control.get("/metrics").expect("GET /metrics");
    assert_eq!(code, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix("fanout_control_source_relists_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Idle on the Kubernetes API, with channels and an Envoy, every status written and
/// nothing changing, the server does next to nothing (under 2 % of one core over 5 s, from
/// its CPU time in /proc), and a change after that is still served.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN: make test-k8s"]
fn an_idle_server_on_the_kubernetes_api_uses_next_to_no_cpu() {
    use crate::harness::control::cpu_time;
    let api = cluster();
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    let subscribers: Vec<Subscriber> = (0..10).map(|i| Subscriber::ok(&format!("s{i}"))).collect();
    let channels: Vec<String> = subscribers
        .iter()
        .enumerate()
        .map(|(i, s)| fanout_channel(&format!("c{i}"), &[uri(s)]))
        .collect();
    api.apply(&channels.join("---\n"));
    for i in 0..subscribers.len() {
        let (name, uid) = (format!("c{i}"), format!("c{i}-0"));
        api.wait_for(("fanoutchannel", NS, &name), "Ready", WAIT, |c| {
            subscriber_status(c, &uid)["ready"] == "True"
        });
    }
    std::thread::sleep(Duration::from_secs(1));
    let (before, start) = (cpu_time(control.pid()), Instant::now());
    std::thread::sleep(Duration::from_secs(5));
    let (used, window) = (cpu_time(control.pid()) - before, start.elapsed());
    eprintln!("k8s: idle with 10 channels and an Envoy: {used:?} of CPU in {window:?}");
    assert!(
        used.as_secs_f64() < 0.02 * window.as_secs_f64(),
        "idle for {window:?}, the server used {used:?} of CPU"
    );
    let x = Subscriber::ok("x");
    let _sender = Sender::start(&host("c0"), &envoy);
    let applied = Instant::now();
    api.apply(&fanout_channel("c0", &[uri(&subscribers[0]), uri(&x)]));
    first_delivery(&x, applied, "x, added after the idle time");
}

/// Resident memory of `pid`, KiB (`VmRSS`).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

/// `(p50, p99)` of `samples`.
fn spread(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

/// `make bench-k8s` (part of `make bench`): 1,000 FanoutChannels on the Kubernetes API, each
/// with one subscriber. From fanout-control's start: the first event through an Envoy, every
/// channel in `/state`, every channel's status Ready; its memory then; and 20 changes among
/// them, each adding a subscriber to one channel (apply to first delivery, apply to its
/// entry Ready); with Knative's controller, 20 Subscriptions to as many channels (apply to
/// first delivery, apply to Ready). Target: p99 apply to delivery <= 2 s.
#[test]
#[ignore = "a benchmark: make bench-k8s"]
fn bench_1000_fanout_channels() {
    const CHANNELS: usize = 1000;
    const CHANGES: usize = 20;
    let api = cluster();
    let knative = crate::harness::kube::knative_given().then(|| Knative::start(&api));
    let base = Subscriber::ok("base");
    let channels: Vec<String> = (0..CHANNELS)
        .map(|i| fanout_channel(&format!("c{i}"), &[uri(&base)]))
        .collect();
    let applying = Instant::now();
    for chunk in channels.chunks(100) {
        api.apply(&chunk.join("---\n"));
    }
    println!(
        "{CHANNELS} FanoutChannels applied in {:?}",
        applying.elapsed()
    );

    let started = Instant::now();
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    let last = format!("c{}", CHANNELS - 1);
    let sender = Sender::start(&host(&last), &envoy);
    let first_serve = first_delivery(&base, started, "the first event after the start");
    drop(sender);
    control.wait_for_state("every channel served", WAIT, |s| {
        s["channels"].as_object().map(|c| c.len()) == Some(CHANNELS)
    });
    let all_served = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let list: Value =
            serde_json::from_str(&api.run(&["get", "fanoutchannels", "-n", NS, "-o", "json"]))
                .unwrap();
        let ready = list["items"].as_array().map_or(0, |items| {
            items
                .iter()
                .filter(|c| c["status"]["subscribers"][0]["ready"] == "True")
                .count()
        });
        if ready == CHANNELS {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{ready} of {CHANNELS} Ready in 120 s"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let all_ready = started.elapsed();
    let rss = rss_kib(control.pid());

    let (mut delivered, mut ready) = (Vec::new(), Vec::new());
    for k in 0..CHANGES {
        let name = format!("c{}", k * (CHANNELS / CHANGES));
        let x = Subscriber::ok(&format!("x{k}"));
        let _sender = Sender::start(&host(&name), &envoy);
        let applied = Instant::now();
        api.apply(&fanout_channel(&name, &[uri(&base), uri(&x)]));
        delivered.push(first_delivery(&x, applied, &format!("x{k} on {name}")));
        let uid = format!("{name}-1");
        api.wait_for(("fanoutchannel", NS, &name), "its entry Ready", WAIT, |c| {
            subscriber_status(c, &uid)["ready"] == "True"
        });
        ready.push(applied.elapsed());
    }
    let (d50, d99) = spread(delivered);
    let (r50, r99) = spread(ready);
    println!("| 1,000 FanoutChannels | |\n|---|---|");
    println!(
        "| start to the first event through an Envoy | {} |",
        ms(first_serve)
    );
    println!(
        "| start to every channel served (`/state`) | {} |",
        ms(all_served)
    );
    println!(
        "| start to every channel's status Ready | {} |",
        ms(all_ready)
    );
    println!("| fanout-control's RSS then | {} MiB |", rss / 1024);
    println!(
        "| a subscriber added to one channel ({CHANGES} changes): apply to first delivery p50 / p99 | {} / {} |",
        ms(d50),
        ms(d99)
    );
    println!(
        "| the same: apply to its entry Ready p50 / p99 | {} / {} |",
        ms(r50),
        ms(r99)
    );
    let mut worst = d99;
    if knative.is_some() {
        let (mut delivered, mut ready) = (Vec::new(), Vec::new());
        for k in 0..CHANGES {
            let name = format!("c{}", k * (CHANNELS / CHANGES) + 1);
            let s = Subscriber::ok(&format!("k{k}"));
            let _sender = Sender::start(&host(&name), &envoy);
            let applied = Instant::now();
            let channel = (
                "messaging.fanout.dev/v1alpha1",
                "FanoutChannel",
                name.as_str(),
            );
            api.apply(&subscription(&format!("k{k}"), channel, &uri(&s)));
            delivered.push(first_delivery(&s, applied, &format!("Subscription k{k}")));
            api.wait_for(
                ("subscription", NS, &format!("k{k}")),
                "Ready",
                WAIT,
                is_ready,
            );
            ready.push(applied.elapsed());
        }
        let (d50, d99) = spread(delivered);
        let (r50, r99) = spread(ready);
        println!(
            "| a Subscription to one channel, Knative's controller ({CHANGES}): apply to first delivery p50 / p99 | {} / {} |",
            ms(d50),
            ms(d99)
        );
        println!(
            "| the same: apply to the Subscription Ready p50 / p99 | {} / {} |",
            ms(r50),
            ms(r99)
        );
        worst = worst.max(d99);
    } else {
        println!("(no Knative: KNATIVE_CONTROLLER_BIN and KNATIVE_EVENTING_SRC not given)");
    }
    assert!(
        worst <= Duration::from_secs(2),
        "target: p99 apply to delivery <= 2 s, got {}",
        ms(worst)
    );
}
