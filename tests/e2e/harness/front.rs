//! A front Envoy over N fanout replicas, the way a channel with many replicas runs: the
//! shipped `envoy/front-affinity.yaml` (MAGLEV on the CloudEvents identity) or the same with
//! round robin and no hash (the worst case for dedupe), its cluster's endpoints the replicas'
//! listeners on loopback. Replicas listen on fixed ports, so that a replica stopped and
//! started again (a rollout) is the same endpoint to the front.

use std::ops::Deref;

use serde_json::{json, Value};

use super::{read_shipped_yaml, Envoy, EnvoyBuilder};

/// How the front spreads requests over the replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balance {
    /// The shipped front: `hash_policy` on `ce-source` and `ce-id`, `MAGLEV`.
    Affinity,
    /// The same front with `ROUND_ROBIN` and no hash policy.
    RoundRobin,
}

/// The front Envoy (derefs to [`Envoy`]: its URL, stats, log).
pub struct Front {
    pub envoy: Envoy,
}

impl Deref for Front {
    type Target = Envoy;

    fn deref(&self) -> &Envoy {
        &self.envoy
    }
}

/// The shipped front configuration with its endpoints on these loopback ports.
pub fn front_bootstrap(balance: Balance, replica_ports: &[u16]) -> Value {
    let mut boot = read_shipped_yaml("envoy/front-affinity.yaml");
    let cluster = &mut boot["static_resources"]["clusters"][0];
    cluster["type"] = json!("STATIC");
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = Value::Array(
        replica_ports
            .iter()
            .map(|port| json!({ "endpoint": { "address": loopback(*port) } }))
            .collect(),
    );
    if balance == Balance::RoundRobin {
        boot["static_resources"]["clusters"][0]["lb_policy"] = json!("ROUND_ROBIN");
        let route = &mut boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"];
        if let Some(route) = route.as_object_mut() {
            route.remove("hash_policy");
        }
    }
    boot["static_resources"]["listeners"][0]["address"] = loopback(0);
    boot["admin"]["address"] = loopback(0);
    boot
}

impl Front {
    /// The front over replicas listening on `replica_ports` (127.0.0.1).
    pub fn start(balance: Balance, replica_ports: &[u16]) -> Front {
        let boot = front_bootstrap(balance, replica_ports);
        // One worker: a round-robin front then alternates strictly, whatever connection a
        // request comes on.
        let mut builder = Envoy::builder().concurrency(1);
        for key in ["admin", "static_resources"] {
            builder = builder.bootstrap_field(key, boot[key].clone());
        }
        Front {
            envoy: builder.start(),
        }
    }

    /// Requests the front sent to each replica, by port (its cluster's per-host stats).
    pub fn requests_per_replica(&self) -> Vec<(u16, u64)> {
        let (_, body) = self.admin_get("/clusters?format=json");
        let doc: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        let mut out = Vec::new();
        for cluster in doc["cluster_statuses"].as_array().into_iter().flatten() {
            if cluster["name"] != "fanout" {
                continue;
            }
            for host in cluster["host_statuses"].as_array().into_iter().flatten() {
                let port = host["address"]["socket_address"]["port_value"]
                    .as_u64()
                    .unwrap_or(0) as u16;
                let total = host["stats"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|s| s["name"] == "rq_total")
                    .and_then(|s| s["value"].as_str().and_then(|v| v.parse().ok()))
                    .or_else(|| {
                        host["stats"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .find(|s| s["name"] == "rq_total")
                            .and_then(|s| s["value"].as_u64())
                    })
                    .unwrap_or(0);
                out.push((port, total));
            }
        }
        out
    }
}

/// A fanout replica: `builder` (the filter and its clusters) with its listener on a fixed
/// loopback port, so that the front reaches it again after a restart.
pub fn start_replica(builder: EnvoyBuilder, port: u16) -> Envoy {
    let mut boot = builder.bootstrap();
    boot["static_resources"]["listeners"][0]["address"] = loopback(port);
    builder
        .bootstrap_field("static_resources", boot["static_resources"].clone())
        .start()
}

fn loopback(port: u16) -> Value {
    json!({ "socket_address": { "address": "127.0.0.1", "port_value": port } })
}
