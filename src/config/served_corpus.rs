//! What fanout-control serves parses here too: natively and, in `make test-wasm`, in wasm32
//! as Envoy runs the filter. The corpus is written by fanout-control's property test
//! (control/src/contract/properties.rs), which fails when it is not what the server serves.

use super::Config;

const SERVED: &str = include_str!("../../tests/fixtures/control/served.jsonl");

#[test]
fn every_configuration_the_control_plane_serves_parses() {
    let mut documents = 0;
    for (line, document) in SERVED.lines().enumerate() {
        if let Err(e) = Config::from_json(document.as_bytes()) {
            panic!("line {}: the filter refuses {document}: {e}", line + 1);
        }
        documents += 1;
    }
    assert!(documents >= 32, "{documents} documents in the corpus");
}
