//! Deciding and rendering what is served, by behaviour.

use super::*;
use crate::knative;
use crate::model::MapOptions;
use envoy_types::pb::envoy::config::cluster::v3::{
    cluster::ClusterDiscoveryType, cluster::DiscoveryType, Cluster,
};
use envoy_types::pb::envoy::config::core::v3::transport_socket;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext;
use prost::{Message, Name};
use serde_json::Value;

fn options() -> RenderOptions {
    RenderOptions {
        build: Build::Wasm("/w/fanout.wasm".into()),
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

fn native(module: &str) -> RenderOptions {
    RenderOptions {
        build: Build::Native(module.into()),
        ..options()
    }
}

/// The plugin configuration the served fanout filter carries, on either build.
fn plugin(served: &Served) -> Value {
    let filter = TypedExtensionConfig::decode(served.ecds[0].value.as_slice()).unwrap();
    let typed = filter.typed_config.unwrap();
    let config = if typed.type_url == DynamicModuleFilter::type_url() {
        let native = DynamicModuleFilter::decode(typed.value.as_slice()).unwrap();
        native.filter_config.unwrap()
    } else {
        let wasm = Wasm::decode(typed.value.as_slice()).unwrap();
        wasm.config.unwrap().configuration.unwrap()
    };
    assert_eq!(config.type_url, StringValue::type_url());
    serde_json::from_str(&StringValue::decode(config.value.as_slice()).unwrap().value).unwrap()
}

/// The served fanout filter as the native build's, decoded.
fn native_filter_of(served: &Served) -> DynamicModuleFilter {
    let filter = TypedExtensionConfig::decode(served.ecds[0].value.as_slice()).unwrap();
    assert_eq!(filter.name, FILTER_NAME);
    let typed = filter.typed_config.unwrap();
    assert_eq!(typed.type_url, DynamicModuleFilter::type_url());
    DynamicModuleFilter::decode(typed.value.as_slice()).unwrap()
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

/// With `--build native` the fanout filter is the native build's dynamic-module filter, with
/// the very configuration the wasm filter gets (one the native build takes), the library
/// kept loaded; by name (Envoy's search path) or by its absolute path.
#[test]
fn the_native_build_is_served_the_same_configuration_as_a_dynamic_module() {
    let objects = vec![
        imc("a", "http://x.example/"),
        imc("b", "https://y.example/"),
    ];
    let snapshot = knative::map(&MapOptions::default(), objects);
    let wasm = serve(&snapshot, None, &options());
    let by_name = serve(&snapshot, None, &native("fanout"));
    assert_eq!(plugin(&by_name), plugin(&wasm));
    let text = plugin(&by_name).to_string();
    let config = fanout_native::configure(text.as_bytes()).unwrap();
    assert_eq!(config.channels.len(), 2);
    let filter = native_filter_of(&by_name);
    assert_eq!(filter.filter_name, "fanout");
    let module = filter.dynamic_module_config.unwrap();
    assert_eq!(module.name, "fanout");
    assert!(module.module.is_none());
    assert!(
        module.do_not_close,
        "the library stays loaded across versions"
    );
    assert!(!filter.terminal_filter);
    // The clusters and the senders filters do not depend on the build.
    assert_eq!(by_name.clusters, wasm.clusters);
    assert_eq!(by_name.ecds[1..], wasm.ecds[1..]);
    assert_eq!(by_name.cds_version, wasm.cds_version);
    assert_ne!(by_name.ecds_version, wasm.ecds_version);

    let by_path = serve(&snapshot, None, &native("/etc/envoy/modules/libfanout.so"));
    let module = native_filter_of(&by_path).dynamic_module_config.unwrap();
    assert_eq!(module.name, "");
    let Some(async_data_source::Specifier::Local(local)) = module.module.unwrap().specifier else {
        panic!("no local file")
    };
    assert_eq!(
        local.specifier,
        Some(data_source::Specifier::Filename(
            "/etc/envoy/modules/libfanout.so".into()
        ))
    );
    assert_ne!(by_path.ecds_version, by_name.ecds_version);
}

/// The JSON views (`/state`'s resources, `render`'s `fanout.yaml`) write the native filter
/// as Envoy reads it from a file.
#[test]
fn the_native_filter_is_written_as_envoys_json() {
    let snapshot = knative::map(&MapOptions::default(), vec![imc("a", "http://x.example/")]);
    let served = serve(&snapshot, None, &native("fanout"));
    let written = crate::resource_json::any(&served.ecds[0]).unwrap();
    let plugin_text = plugin(&served).to_string();
    assert_eq!(
        written,
        json!({
            "@type": TypedExtensionConfig::type_url(),
            "name": "fanout",
            "typed_config": {
                "@type": DynamicModuleFilter::type_url(),
                "dynamic_module_config": { "name": "fanout", "do_not_close": true },
                "filter_name": "fanout",
                "filter_config": { "@type": StringValue::type_url(), "value": plugin_text }
            }
        })
    );
    let served = serve(&snapshot, None, &native("/m/libfanout.so"));
    let written = crate::resource_json::any(&served.ecds[0]).unwrap();
    assert_eq!(
        written["typed_config"]["dynamic_module_config"],
        json!({ "module": { "local": { "filename": "/m/libfanout.so" } }, "do_not_close": true })
    );
}

/// What Knative objects ask for (a reply, a dead letter) the native build serves as the wasm
/// build does: every channel is served, and the filter's configuration is one the native
/// build takes. (What it refuses is charged to the channel that asks for it: `contract`.)
#[test]
fn knative_channels_with_replies_and_dead_letters_are_served_to_the_native_build() {
    let mut replying = imc("a", "http://x.example/");
    replying["spec"]["subscribers"][0]["replyUri"] = json!("http://r.example/r");
    replying["spec"]["subscribers"][0]["delivery"] =
        json!({ "deadLetterSink": { "uri": "http://d.example/d" } });
    let objects = vec![replying, imc("b", "http://y.example/")];
    let snapshot = knative::map(&MapOptions::default(), objects);
    let served = serve(&snapshot, None, &native("fanout"));
    for name in ["default/a", "default/b"] {
        assert_eq!(served.channels[name].serving, Serving::Current, "{name}");
    }
    let config = plugin(&served);
    let subscriber = &config["channels"][0]["subscribers"][0];
    assert_eq!(
        subscriber["reply"]["cluster"], "http|r.example|80",
        "{config}"
    );
    assert_eq!(
        subscriber["delivery"]["dead_letter"]["cluster"], "http|d.example|80",
        "{config}"
    );
    assert!(fanout_native::configure(config.to_string().as_bytes()).is_ok());
}
