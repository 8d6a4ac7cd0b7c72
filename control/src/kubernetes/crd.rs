//! The FanoutChannel kind (`fanoutchannels.messaging.fanout.dev`, v1alpha1): a Knative
//! channel whose data plane is fanout. Its spec and status are Knative's Channelable duck
//! type, field for field, so that Knative's controller manages it as it manages an
//! InMemoryChannel. `deploy/kubernetes/fanoutchannel.yaml` (the CustomResourceDefinition and
//! the two aggregated ClusterRoles) is generated from these types by the test that checks it.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The API group of FanoutChannel.
pub const GROUP: &str = "messaging.fanout.dev";

/// A FanoutChannel from the API: one Knative creates has no `spec` until it has subscribers.
pub fn from_object(object: &impl Serialize) -> Result<FanoutChannel, serde_json::Error> {
    let mut value = serde_json::to_value(object)?;
    if let Some(fields) = value.as_object_mut() {
        fields
            .entry("spec")
            .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    }
    serde_json::from_value(value)
}

/// A Knative channel whose events fanout delivers: Knative's Channelable spec
/// (`subscribers`, `delivery`).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "messaging.fanout.dev",
    version = "v1alpha1",
    kind = "FanoutChannel",
    doc = "A Knative channel whose data plane is fanout: Knative's Channelable duck type.",
    plural = "fanoutchannels",
    singular = "fanoutchannel",
    shortname = "fch",
    namespaced,
    status = "FanoutChannelStatus",
    category = "all",
    category = "knative",
    category = "messaging",
    category = "channel",
    label("messaging.knative.dev/subscribable", "true"),
    label("duck.knative.dev/addressable", "true"),
    label("knative.dev/crd-install", "true"),
    printcolumn = r#"{"name": "URL", "type": "string", "jsonPath": ".status.address.url"}"#,
    printcolumn = r#"{"name": "Ready", "type": "string",
        "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name": "Reason", "type": "string",
        "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct FanoutChannelSpec {
    /// The subscribers, as Knative's Subscription controller writes them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subscribers: Vec<SubscriberSpec>,
    /// The channel's delivery: what a subscriber without its own gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliverySpec>,
}

/// One subscriber of the channel (Knative's `SubscriberSpec`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriberSpec {
    /// The Subscription's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The Subscription's uid: the key of `status.subscribers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The Subscription's generation this entry was written from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// Where events go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscriber_uri: Option<String>,
    /// PEM CA certificates for an https subscriber.
    #[serde(
        default,
        rename = "subscriberCACerts",
        skip_serializing_if = "Option::is_none"
    )]
    pub subscriber_ca_certs: Option<String>,
    /// The OIDC audience of the subscriber.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscriber_audience: Option<String>,
    /// Where the subscriber's replies go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_uri: Option<String>,
    /// PEM CA certificates for an https reply target.
    #[serde(
        default,
        rename = "replyCACerts",
        skip_serializing_if = "Option::is_none"
    )]
    pub reply_ca_certs: Option<String>,
    /// The OIDC audience of the reply target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_audience: Option<String>,
    /// The subscriber's own delivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliverySpec>,
    /// The identity the subscriber is called with (OIDC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthStatus>,
}

/// Knative's `AuthStatus`: the service accounts an OIDC token is requested for.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuthStatus {
    /// One service account.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Several service accounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_account_names: Vec<String>,
}

/// Knative's `DeliverySpec`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliverySpec {
    /// Where events that failed for good go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_sink: Option<Destination>,
    /// Retries after the first attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<i32>,
    /// Each attempt's timeout, an ISO 8601 duration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// `linear` or `exponential`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_policy: Option<BackoffPolicy>,
    /// The backoff's base delay, an ISO 8601 duration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_delay: Option<String>,
    /// The longest `Retry-After` honoured, an ISO 8601 duration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_max: Option<String>,
    /// The content mode subscribers get: `json` (structured) or `binary`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Format>,
}

/// How the wait between retries grows.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum BackoffPolicy {
    /// delay × attempt.
    Linear,
    /// delay × 2^attempt.
    Exponential,
}

/// The content mode of the events a subscriber gets.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Format {
    /// Structured mode.
    Json,
    /// Binary mode.
    Binary,
}

/// Knative's `Destination`: an object reference, a URI (relative to the reference's
/// address when both are set), or both.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Destination {
    /// An addressable object.
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<KReference>,
    /// An absolute URI, or one relative to the reference's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    /// PEM CA certificates for an https destination.
    #[serde(default, rename = "CACerts", skip_serializing_if = "Option::is_none")]
    pub ca_certs: Option<String>,
    /// The OIDC audience of the destination.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
}

/// Knative's `KReference`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KReference {
    /// The object's kind.
    pub kind: String,
    /// The object's namespace (the channel's when empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The object's name.
    pub name: String,
    /// The object's API version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// The object's API group (Knative resolves the version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Which of the object's addresses, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
}

/// Knative's Channelable status.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FanoutChannelStatus {
    /// The generation this status was written for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Addressable`, `DispatcherReady`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Knative's status annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Where senders send: `http://<name>-kn-channel.<namespace>.svc.cluster.local`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<Addressable>,
    /// Every address of the channel.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<Addressable>,
    /// Per subscriber: whether fanout serves it at its generation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subscribers: Vec<SubscriberStatus>,
    /// `spec.delivery.deadLetterSink`, resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_sink_uri: Option<String>,
    /// The dead-letter sink's CA certificates.
    #[serde(
        default,
        rename = "deadLetterSinkCACerts",
        skip_serializing_if = "Option::is_none"
    )]
    pub dead_letter_sink_ca_certs: Option<String>,
    /// The dead-letter sink's OIDC audience.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_sink_audience: Option<String>,
    /// The EventPolicies that apply to the channel.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<AppliedEventPolicy>,
}

/// Knative's `Addressable`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Addressable {
    /// The address's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The URL senders send to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// PEM CA certificates for an https address.
    #[serde(default, rename = "CACerts", skip_serializing_if = "Option::is_none")]
    pub ca_certs: Option<String>,
    /// The OIDC audience senders' tokens are for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
}

/// Knative's `SubscriberStatus`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubscriberStatus {
    /// The Subscription's uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The subscriber's generation this entry is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `True`, `False` or `Unknown`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Why it is not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The identity the subscriber is called with (OIDC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthStatus>,
}

/// Knative's `Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready`, `Addressable`, `DispatcherReady`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// `Error` (empty), `Warning` or `Info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub severity: Option<String>,
    /// When `status` last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// One CamelCase word.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What is wrong, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Knative's `AppliedEventPolicyRef`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedEventPolicy {
    /// The EventPolicy's API version.
    pub api_version: String,
    /// The EventPolicy's name.
    pub name: String,
}

/// The shipped manifest, generated by the test that checks it
/// (`FANOUT_WRITE_CRD=1 cargo test -p fanout-control crd::`).
#[cfg(test)]
mod generate {
    use super::*;
    use k8s_openapi::api::rbac::v1::{ClusterRole, PolicyRule};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::CustomResourceExt;

    /// A ClusterRole that Knative's aggregated roles pick up by `label`.
    fn aggregated_role(name: &str, label: &str, resources: &[&str], verbs: &[&str]) -> ClusterRole {
        let strings = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        ClusterRole {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(BTreeMap::from([(label.to_owned(), "true".to_owned())])),
                ..ObjectMeta::default()
            },
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec![GROUP.to_owned()]),
                resources: Some(strings(resources)),
                verbs: strings(verbs),
                ..PolicyRule::default()
            }]),
            ..ClusterRole::default()
        }
    }

    /// The CRD as shipped: `spec` is not required, since Knative creates a Channel's
    /// FanoutChannel without one.
    pub fn crd() -> serde_json::Value {
        let mut crd = serde_json::to_value(FanoutChannel::crd()).unwrap_or_default();
        if let Some(versions) = crd["spec"]["versions"].as_array_mut() {
            for version in versions {
                let schema = &mut version["schema"]["openAPIV3Schema"];
                if let Some(required) = schema["required"].as_array_mut() {
                    required.retain(|r| r != "spec");
                    if required.is_empty() {
                        schema.as_object_mut().map(|s| s.remove("required"));
                    }
                }
            }
        }
        crd
    }

    /// The shipped manifest: the CRD, then the ClusterRoles that let Knative's controller
    /// manage FanoutChannels (`duck.knative.dev/channelable`) and resolve their addresses
    /// (`duck.knative.dev/addressable`) once aggregated into its own roles.
    pub fn manifest() -> Result<String, serde_yaml_ng::Error> {
        let channelable = aggregated_role(
            "fanoutchannel-channelable-manipulator",
            "duck.knative.dev/channelable",
            &["fanoutchannels", "fanoutchannels/status"],
            &[
                "get", "list", "watch", "create", "update", "patch", "delete",
            ],
        );
        let addressable = aggregated_role(
            "fanoutchannel-addressable-resolver",
            "duck.knative.dev/addressable",
            &["fanoutchannels", "fanoutchannels/status"],
            &["get", "list", "watch"],
        );
        let mut out = String::from(
            "# FanoutChannel: a Knative channel whose data plane is fanout (docs/knative.md).\n\
             # Generated from control/src/kubernetes/crd.rs: FANOUT_WRITE_CRD=1 cargo test -p \
             fanout-control crd::\n",
        );
        let documents = [
            serde_yaml_ng::to_string(&crd())?,
            serde_yaml_ng::to_string(&channelable)?,
            serde_yaml_ng::to_string(&addressable)?,
        ];
        out.push_str(&documents.join("---\n"));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::generate::{crd, manifest};
    use super::*;
    use serde_json::json;

    const SHIPPED: &str = "../deploy/kubernetes/fanoutchannel.yaml";

    /// The shipped manifest is what the types say; `FANOUT_WRITE_CRD=1` writes it.
    #[test]
    fn the_shipped_crd_is_generated_from_the_types() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(SHIPPED);
        let generated = manifest().unwrap();
        if std::env::var_os("FANOUT_WRITE_CRD").is_some() {
            std::fs::write(&path, &generated).unwrap();
        }
        let shipped = std::fs::read_to_string(&path).unwrap();
        assert!(
            shipped == generated,
            "{} differs from the types in control/src/kubernetes/crd.rs: run \
             FANOUT_WRITE_CRD=1 cargo test -p fanout-control crd::",
            path.display()
        );
    }

    #[test]
    fn the_crd_is_knatives_channel_kind() {
        let crd = crd();
        assert_eq!(
            crd["metadata"]["name"],
            "fanoutchannels.messaging.fanout.dev"
        );
        for label in [
            "messaging.knative.dev/subscribable",
            "duck.knative.dev/addressable",
            "knative.dev/crd-install",
        ] {
            assert_eq!(crd["metadata"]["labels"][label], "true", "{label}");
        }
        assert_eq!(
            crd["spec"]["names"]["categories"],
            json!(["all", "knative", "messaging", "channel"])
        );
        assert_eq!(crd["spec"]["scope"], "Namespaced");
        let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        assert!(
            !root.to_string().contains("\"required\":[\"spec\"]"),
            "{root}"
        );
        let version = &crd["spec"]["versions"][0];
        assert_eq!(version["name"], "v1alpha1");
        assert_eq!(version["subresources"]["status"], json!({}));
        let schema = &version["schema"]["openAPIV3Schema"]["properties"];
        let subscriber = &schema["spec"]["properties"]["subscribers"]["items"]["properties"];
        for field in [
            "uid",
            "generation",
            "name",
            "subscriberUri",
            "subscriberCACerts",
            "subscriberAudience",
            "replyUri",
            "replyCACerts",
            "replyAudience",
            "delivery",
        ] {
            assert!(
                subscriber.get(field).is_some(),
                "spec.subscribers[].{field}"
            );
        }
        let status = &schema["status"]["properties"];
        for field in [
            "address",
            "addresses",
            "subscribers",
            "conditions",
            "observedGeneration",
            "deadLetterSinkUri",
        ] {
            assert!(status.get(field).is_some(), "status.{field}");
        }
        assert!(
            schema["spec"]["properties"]["delivery"]["properties"]["deadLetterSink"]
                .get("properties")
                .is_some()
        );
    }

    /// What Knative's controller writes reads back unchanged.
    #[test]
    fn a_channel_as_knative_writes_it_round_trips() {
        let object = json!({
            "apiVersion": "messaging.fanout.dev/v1alpha1", "kind": "FanoutChannel",
            "metadata": { "name": "orders", "namespace": "shop" },
            "spec": {
                "subscribers": [{
                    "uid": "u1", "generation": 2, "name": "billing",
                    "subscriberUri": "http://billing.shop.svc.cluster.local/",
                    "subscriberCACerts": "PEM", "subscriberAudience": "billing",
                    "replyUri": "http://reply.shop.svc.cluster.local/",
                    "delivery": { "retry": 3, "backoffPolicy": "exponential", "format": "json" }
                }],
                "delivery": { "deadLetterSink": { "ref": { "kind": "Service", "name": "dls",
                    "apiVersion": "v1" }, "CACerts": "PEM" } }
            },
            "status": {
                "observedGeneration": 4,
                "address": { "url": "http://orders-kn-channel.shop.svc.cluster.local" },
                "subscribers": [{ "uid": "u1", "observedGeneration": 2, "ready": "True" }],
                "conditions": [{ "type": "Ready", "status": "True",
                    "lastTransitionTime": "2026-01-01T00:00:00Z" }],
                "deadLetterSinkUri": "http://dls.shop.svc.cluster.local"
            }
        });
        let channel: FanoutChannel = serde_json::from_value(object.clone()).unwrap();
        assert_eq!(serde_json::to_value(&channel).unwrap(), object);
    }
}
