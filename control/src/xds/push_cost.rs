//! What one change to one channel among 1,000 costs the server, the way `make
//! bench-control` makes it (one file of 1,000 InMemoryChannels, each with its own
//! subscriber cluster, three Envoys), without the noise of a shared machine: the whole path
//! of the change (the file parsed, mapped, decided, rendered, recorded, sent to each Envoy
//! and encoded, each ACK taken) in one function, [`one_change`], whose instructions
//! valgrind counts (and one `GET /state`, [`one_report`]):
//!
//! ```text
//! CARGO_PROFILE_RELEASE_STRIP=false cargo test --release -p fanout-control --no-run
//! valgrind --tool=callgrind --toggle-collect='*push_cost*one_change*' \
//!   target/release/deps/fanout_control-HASH --ignored --exact \
//!   xds::push_cost::one_change_among_1000_channels
//! callgrind_annotate --inclusive=yes callgrind.out.PID
//! ```

use super::{StreamState, CLUSTER_TYPE, FILTER_TYPE};
use crate::contract::Build;
use crate::model::{MapOptions, Snapshot};
use crate::render::{serve, RenderOptions, Served};
use crate::source::{mapped, parse, Listing};
use crate::state::Ledger;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use prost::Message;
use std::sync::Arc;

/// The bench's file: 1,000 channels, `changed` more subscribers on channel 500.
fn channels(changed: usize) -> String {
    (0..1000)
        .map(|i| {
            let mut uris = vec![format!("http://127.0.0.1:{}/", 20000 + i)];
            if i == 500 {
                uris.extend((0..changed).map(|c| format!("http://127.0.0.1:{}/c", 20000 + c)));
            }
            let entries: Vec<String> = uris
                .iter()
                .map(|u| format!("    - {{subscriberUri: '{u}'}}"))
                .collect();
            format!(
                "---\napiVersion: messaging.knative.dev/v1\nkind: InMemoryChannel\n\
                 metadata: {{name: c{i}, namespace: default}}\nspec:\n  subscribers:\n{}\n\
                 status:\n  address: {{url: 'http://c{i}.example'}}\n",
                entries.join("\n")
            )
        })
        .collect()
}

fn options() -> RenderOptions {
    RenderOptions {
        build: Build::Wasm("/w/fanout.wasm".into()),
        trusted_ca: "/ca.crt".into(),
        oidc: None,
        resolve: Vec::new(),
        connect_timeout: std::time::Duration::from_secs(1),
    }
}

fn request(type_url: &str, node: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        node: Some(Node {
            id: node.into(),
            ..Node::default()
        }),
        type_url: type_url.into(),
        response_nonce: nonce.into(),
        ..DiscoveryRequest::default()
    }
}

/// Send what `stream` has to send, encoded as tonic would, and ACK it, until it is current.
fn push(stream: &mut StreamState, node: &str, served: &Served, ledger: &Ledger) -> usize {
    let mut bytes = 0;
    loop {
        let responses: Vec<DiscoveryResponse> = stream.step(served, ledger);
        if responses.is_empty() {
            return bytes;
        }
        for response in responses {
            bytes += response.encode_to_vec().len();
            stream.on_request(&request(&response.type_url, node, &response.nonce), ledger);
        }
    }
}

/// The measured part: one change, from the file's text to every Envoy's ACK.
#[inline(never)]
fn one_change(
    text: &str,
    last: &Snapshot,
    previous: &Arc<Served>,
    ledger: &Ledger,
    streams: &mut [(String, StreamState)],
) -> (Arc<Served>, usize) {
    let objects = parse(text.as_bytes()).unwrap();
    let listing = Listing {
        objects,
        problems: Vec::new(),
    };
    let snapshot = mapped(&MapOptions::default(), listing);
    assert!(snapshot != *last);
    let served = Arc::new(serve(&snapshot, Some(previous), &options()));
    ledger.serving(served.clone());
    let bytes = streams
        .iter_mut()
        .map(|(node, stream)| push(stream, node, &served, ledger))
        .sum();
    (served, bytes)
}

/// One `GET /state` (what the bench asks every 50 ms while it waits for the ACKs).
#[inline(never)]
fn one_report(ledger: &Ledger) -> usize {
    ledger.report().to_string().len()
}

#[test]
#[ignore = "a measurement: run under valgrind (see the module's doc)"]
fn one_change_among_1000_channels() {
    let ledger = Ledger::default();
    let listing = |text: String| Listing {
        objects: parse(text.as_bytes()).unwrap(),
        problems: Vec::new(),
    };
    let first = mapped(&MapOptions::default(), listing(channels(0)));
    let served = Arc::new(serve(&first, None, &options()));
    ledger.serving(served.clone());
    let mut streams: Vec<(String, StreamState)> = (0..3)
        .map(|k| (format!("e{k}"), StreamState::default()))
        .collect();
    for (node, stream) in &mut streams {
        stream.on_request(&request(CLUSTER_TYPE, node, ""), &ledger);
        stream.on_request(&request(FILTER_TYPE, node, ""), &ledger);
        push(stream, node, &served, &ledger);
    }
    let (after, bytes) = one_change(&channels(1), &first, &served, &ledger, &mut streams);
    assert_eq!(after.channels["default/c500"].spec.subscribers.len(), 2);
    assert!(bytes > 0);
    println!(
        "sent {bytes} bytes to 3 Envoys; the state is {} bytes",
        one_report(&ledger)
    );
}
