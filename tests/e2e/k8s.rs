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

    api.restart();
    // Served all along from the last whole list.
    first_delivery(&a, Instant::now(), "a right after the restart");
    let applied = Instant::now();
    api.apply(&fanout_channel("returns", &[uri(&b)]));
    let _returns = Sender::start(&host("returns"), &envoy);
    let took = first_delivery(&b, applied, "a channel made after the restart");
    eprintln!("k8s: apply to first delivery after an apiserver restart: {took:?}");
    assert!(channel_state(&control, "orders").is_object());
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

/// A Subscription to a FanoutChannel, with Knative's controller: Knative writes it into the
/// channel's `spec.subscribers`; fanout serves it. Apply-to-first-delivery times over
/// several Subscriptions, p50 and p99.
#[test]
#[ignore = "needs KUBE_APISERVER_BIN, KNATIVE_CONTROLLER_BIN, KNATIVE_EVENTING_SRC: make test-k8s"]
fn knative_a_subscription_is_delivered_through_fanout() {
    let api = cluster();
    let knative = Knative::start(&api);
    let control = Control::start_kubernetes(&api.kubeconfig, free_ports(1)[0], &[]);
    let envoy = xds_envoy("k1", control.xds_port).start();
    api.apply(&fanout_channel("orders", &[]));
    let _sender = Sender::start(&host("orders"), &envoy);
    let mut times = Vec::new();
    let subscribers: Vec<Subscriber> = (0..5).map(|i| Subscriber::ok(&format!("s{i}"))).collect();
    for (i, s) in subscribers.iter().enumerate() {
        let applied = Instant::now();
        api.apply(&format!(
            "apiVersion: messaging.knative.dev/v1\nkind: Subscription\nmetadata: {{name: s{i}, \
             namespace: {NS}}}\nspec:\n  channel: {{apiVersion: messaging.fanout.dev/v1alpha1, \
             kind: FanoutChannel, name: orders}}\n  subscriber: {{uri: '{}'}}\n",
            uri(s)
        ));
        let took = first_delivery(s, applied, &format!("Subscription s{i}: {}", knative.log()));
        times.push(took);
    }
    times.sort();
    eprintln!(
        "k8s: Subscription apply to first delivery with Knative's controller: {:?} (p50 {:?}, \
         max {:?})",
        times,
        times[times.len() / 2],
        times[times.len() - 1]
    );
    let channel = api.get("fanoutchannel", NS, "orders").unwrap();
    assert_eq!(
        channel["spec"]["subscribers"].as_array().map(Vec::len),
        Some(5)
    );
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
