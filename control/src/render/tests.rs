//! Deciding and rendering what is served, by behaviour.

use super::*;
use crate::knative;
use crate::model::MapOptions;
use envoy_types::pb::envoy::config::cluster::v3::{
    cluster::ClusterDiscoveryType, cluster::DiscoveryType, Cluster,
};
use envoy_types::pb::envoy::config::core::v3::transport_socket;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext;
use prost::Message;
use serde_json::Value;

fn options() -> RenderOptions {
    RenderOptions {
        wasm: "/w/fanout.wasm".into(),
        trusted_ca: "/ca.crt".into(),
        oidc: None,
        resolve: Vec::new(),
        connect_timeout: std::time::Duration::from_secs(1),
    }
}

fn imc(name: &str, uri: &str) -> Value {
    json!({
        "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
        "metadata": { "name": name, "namespace": "default" },
        "spec": { "subscribers": [{ "subscriberUri": uri }] },
        "status": { "address": { "url": format!("http://{name}.example") } }
    })
}

fn plugin(served: &Served) -> Value {
    let filter = TypedExtensionConfig::decode(served.ecds[0].value.as_slice()).unwrap();
    let wasm = Wasm::decode(filter.typed_config.unwrap().value.as_slice()).unwrap();
    let config = wasm.config.unwrap().configuration.unwrap();
    serde_json::from_str(&StringValue::decode(config.value.as_slice()).unwrap().value).unwrap()
}

#[test]
fn a_bad_channel_keeps_its_last_good_version_and_the_rest_moves() {
    let first = serve(
        &knative::map(
            &MapOptions::default(),
            vec![imc("a", "http://x.example/"), imc("b", "http://y.example/")],
        ),
        None,
        &options(),
    );
    assert_eq!(first.clusters.len(), 2);
    let second = serve(
        &knative::map(
            &MapOptions::default(),
            vec![imc("a", "ftp://x.example/"), imc("b", "http://z.example/")],
        ),
        Some(&first),
        &options(),
    );
    assert_eq!(second.channels["default/a"].serving, Serving::LastGood);
    assert_eq!(
        second.channels["default/a"].digest,
        first.channels["default/a"].digest
    );
    assert_eq!(second.channels["default/b"].serving, Serving::Current);
    let config = plugin(&second);
    assert_eq!(
        config["channels"][0]["subscribers"][0]["cluster"],
        "http|x.example|80"
    );
    assert_eq!(
        config["channels"][1]["subscribers"][0]["cluster"],
        "http|z.example|80"
    );
    let new = serve(
        &knative::map(&MapOptions::default(), vec![imc("c", "ftp://x.example/")]),
        None,
        &options(),
    );
    assert_eq!(new.channels["default/c"].serving, Serving::NotServed);
    assert_eq!(plugin(&new)["channels"], json!([]));
}

/// A channel of another namespace whose address names a served channel's host (the
/// filter refuses a host claimed twice) is that channel's problem: the served one keeps
/// its host and its changes are served, whichever name sorts first.
#[test]
fn a_host_claimed_again_is_the_claimants_problem() {
    let channel = |namespace: &str, name: &str, subscribers: &[&str]| {
        let entries: Vec<Value> = subscribers
            .iter()
            .map(|u| json!({ "subscriberUri": u }))
            .collect();
        json!({
            "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
            "metadata": { "name": name, "namespace": namespace },
            "spec": { "subscribers": entries },
            "status": { "address": { "url": "http://orders.shop.example" } }
        })
    };
    let map = |objects| knative::map(&MapOptions::default(), objects);
    let first = serve(
        &map(vec![channel("shop", "orders", &["http://a.example/"])]),
        None,
        &options(),
    );
    let both = vec![
        channel(
            "shop",
            "orders",
            &["http://a.example/", "http://b.example/"],
        ),
        channel("another", "orders", &["http://evil.example/"]),
    ];
    let second = serve(&map(both), Some(&first), &options());
    let orders = &second.channels["shop/orders"];
    assert_eq!(orders.serving, Serving::Current);
    assert_eq!(orders.spec.subscribers.len(), 2);
    let claimant = &second.channels["another/orders"];
    assert_eq!(claimant.serving, Serving::NotServed);
    assert_eq!(claimant.problems[0].field, "status.address.url");
    assert!(
        claimant.problems[0].message.contains("shop/orders"),
        "{:?}",
        claimant.problems
    );
    let config = plugin(&second);
    assert_eq!(config["channels"].as_array().map(Vec::len), Some(1));
    let parsed = fanout::config::Config::from_json(config.to_string().as_bytes());
    assert!(parsed.is_ok(), "{parsed:?}");
    // Both served, and the one whose name sorts first takes the other's host: it is
    // charged, and keeps its last good version.
    let mut taker = channel("another", "orders", &["http://a.example/"]);
    taker["status"]["address"]["url"] = json!("http://another.example");
    let third = serve(
        &map(vec![
            channel("shop", "orders", &["http://a.example/"]),
            taker.clone(),
        ]),
        Some(&second),
        &options(),
    );
    assert_eq!(third.channels["another/orders"].serving, Serving::Current);
    taker["status"]["addresses"] = json!([{ "url": "http://orders.shop.example" }]);
    let fourth = serve(
        &map(vec![
            channel("shop", "orders", &["http://a.example/"]),
            taker,
        ]),
        Some(&third),
        &options(),
    );
    assert_eq!(fourth.channels["shop/orders"].serving, Serving::Current);
    let taker = &fourth.channels["another/orders"];
    assert_eq!(taker.serving, Serving::LastGood, "{:?}", taker.problems);
    assert_eq!(taker.spec.hosts, vec!["another.example"]);
}

#[test]
fn resolve_points_a_cluster_elsewhere_and_keeps_its_tls_name() {
    let parse = |s: &str| s.parse::<Resolve>();
    assert_eq!(
        parse("x.example:443=127.0.0.1:8443").unwrap(),
        Resolve {
            spec: "x.example:443=127.0.0.1:8443".into(),
            host: "x.example".into(),
            port: Some(443),
            address: "127.0.0.1".into(),
            address_port: 8443,
        }
    );
    assert_eq!(parse("[::1]=[::1]:9").unwrap().host, "::1");
    assert_eq!(parse("X.example=h:9").unwrap().port, None);
    assert!(parse("x.example").is_err());
    assert!(parse("x.example=127.0.0.1").is_err());
    assert!(parse("x.example=127.0.0.1:0").is_err());
    assert!(parse("x.example:http=127.0.0.1:9").is_err());
    let options = RenderOptions {
        resolve: vec![
            parse("x.example=127.0.0.1:8443").unwrap(),
            parse("y.example:80=127.0.0.1:9").unwrap(),
            parse("nobody.example=127.0.0.1:9").unwrap(),
        ],
        ..options()
    };
    let served = serve(
        &knative::map(
            &MapOptions::default(),
            vec![
                imc("a", "https://x.example/"),
                imc("b", "http://y.example:81/"),
            ],
        ),
        None,
        &options,
    );
    let x = Cluster::decode(served.clusters["https|x.example|443"].value.as_slice()).unwrap();
    assert_eq!(
        x.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32))
    );
    let endpoint = format!("{:?}", x.load_assignment.unwrap().endpoints);
    assert!(endpoint.contains("\"127.0.0.1\"") && endpoint.contains("PortValue(8443)"));
    let Some(transport_socket::ConfigType::TypedConfig(tls)) =
        x.transport_socket.unwrap().config_type
    else {
        panic!("no TLS")
    };
    let tls = UpstreamTlsContext::decode(tls.value.as_slice()).unwrap();
    assert_eq!(tls.sni, "x.example", "the SNI stays the URI's host");
    // y.example:80 does not resolve y.example:81.
    let y = Cluster::decode(served.clusters["http|y.example|81"].value.as_slice()).unwrap();
    assert!(format!("{:?}", y.load_assignment).contains("\"y.example\""));
    let unused: Vec<_> = served.warnings.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(
        unused,
        vec!["y.example:80=127.0.0.1:9", "nobody.example=127.0.0.1:9"]
    );
}

#[test]
fn versions_are_digests_of_the_content() {
    let objects = vec![imc("a", "https://x.example/")];
    let one = serve(
        &knative::map(&MapOptions::default(), objects.clone()),
        None,
        &options(),
    );
    let two = serve(
        &knative::map(&MapOptions::default(), objects),
        None,
        &options(),
    );
    assert_eq!(
        (one.ecds_version.clone(), one.cds_version.clone()),
        (two.ecds_version, two.cds_version)
    );
    let other = serve(
        &knative::map(&MapOptions::default(), vec![imc("a", "https://y.example/")]),
        None,
        &options(),
    );
    assert_ne!(one.ecds_version, other.ecds_version);
    assert_ne!(one.cds_version, other.cds_version);
    let cluster = Cluster::decode(one.clusters["https|x.example|443"].value.as_slice()).unwrap();
    let Some(transport_socket::ConfigType::TypedConfig(tls)) =
        cluster.transport_socket.unwrap().config_type
    else {
        panic!("no TLS")
    };
    assert_eq!(
        UpstreamTlsContext::decode(tls.value.as_slice())
            .unwrap()
            .sni,
        "x.example"
    );
}
