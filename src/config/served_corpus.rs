//! What fanout-control serves parses here too: natively and, in `make test-wasm`, in wasm32
//! as Envoy runs the filter. The corpus is written by fanout-control's property test
//! (control/src/contract/properties.rs), which fails when it is not what the server serves.

use super::Config;

const SERVED: &str = include_str!("../../tests/fixtures/control/served.jsonl");

#[test]
fn every_configuration_the_control_plane_serves_parses() {
    let refused: Vec<String> = SERVED
        .lines()
        .enumerate()
        .filter_map(|(line, document)| {
            let refusal = Config::from_json(document.as_bytes()).err()?;
            Some(format!(
                "line {}: the filter refuses {document}: {refusal}",
                line + 1
            ))
        })
        .collect();
    assert!(refused.is_empty(), "{}", refused.join("\n"));
    let documents = SERVED.lines().count();
    assert!(documents >= 32, "{documents} documents in the corpus");
}
