//! What a source says fanout should serve: channels with their subscribers and the clusters
//! those call, or, per channel, why it could not be mapped. No I/O here.

use fanout::config::RawSubscriber;
use serde::Serialize;
use std::collections::BTreeMap;

/// Something of the source that could not be carried over, named by object and field.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Problem {
    /// `Kind namespace/name`, or a file of the source.
    pub object: String,
    /// The field, as a path (`spec.subscribers[0].delivery.retry`).
    pub field: String,
    pub message: String,
}

impl Problem {
    pub fn new(object: &str, field: &str, message: impl Into<String>) -> Problem {
        Problem {
            object: object.to_owned(),
            field: field.to_owned(),
            message: message.into(),
        }
    }
}

/// One upstream the filter calls: an Envoy cluster per scheme, host and port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClusterSpec {
    /// `scheme|host|port`, as the filter's targets name it.
    pub name: String,
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// PEM CA certificates the https upstream must be signed by; empty: the trust store.
    pub ca_certs: Vec<String>,
}

/// One subscriber as the filter's configuration has it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SubscriberSpec {
    /// The URI it is called at (for people: the state endpoint shows it).
    pub uri: String,
    /// Its entry of the filter's `subscribers` (docs/configuration.md), as the filter's own
    /// type.
    pub config: RawSubscriber,
    /// The object of the source it comes from, and where in it (what the filter refuses of
    /// `config` is charged there).
    #[serde(skip)]
    pub object: String,
    #[serde(skip)]
    pub field: String,
}

/// Who may send to a channel (Knative's OIDC authentication and EventPolicies): a token for
/// `audience` from the server's issuer, whose subject is one of `allowed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Senders {
    /// The audience a sender's token must carry (the channel's `status.address.audience`).
    pub audience: String,
    pub allowed: Allowed,
}

/// The subjects that may send.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Allowed {
    /// Any subject with a valid token (the default mode `allow-all`).
    Any,
    /// These subjects: each exact or, ending in `*`, a prefix; compared without case. None:
    /// nobody (`deny-all`).
    Subjects(Vec<String>),
}

/// One fanout channel as the source wants it served.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChannelSpec {
    pub hosts: Vec<String>,
    pub subscribers: Vec<SubscriberSpec>,
    /// Every cluster its subscribers, replies and dead letters call, by name.
    pub clusters: BTreeMap<String, ClusterSpec>,
    /// Who may send; `None`: senders are not checked (the server runs without an OIDC issuer).
    pub senders: Option<Senders>,
}

/// A channel of the source: what it maps to, and what of it did not map. A channel with
/// problems is not served as it is now (the server keeps its last good version, if any); a
/// warning says what is served differently from Knative, and the channel is served.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChannelMapping {
    /// The object it comes from, as problems name it (`InMemoryChannel namespace/name`).
    #[serde(skip)]
    pub object: String,
    pub spec: ChannelSpec,
    pub problems: Vec<Problem>,
    pub warnings: Vec<Problem>,
}

impl ChannelMapping {
    /// The object it comes from, as problems name it; `name` where none is known.
    pub fn object_or<'a>(&'a self, name: &'a str) -> &'a str {
        if self.object.is_empty() {
            name
        } else {
            &self.object
        }
    }
}

/// Everything a source says at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Snapshot {
    /// By channel name (`namespace/name`).
    pub channels: BTreeMap<String, ChannelMapping>,
    /// What belongs to no channel (an unreadable file, a Subscription of a missing channel).
    pub problems: Vec<Problem>,
    /// Warnings that belong to no channel (an object of a kind fanout does not serve).
    pub warnings: Vec<Problem>,
}

/// Who may send to a channel no EventPolicy applies to: Knative's
/// `default-authorization-mode` feature flag, same words, same default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthorizationMode {
    /// Subjects of the channel's namespace (`system:serviceaccount:<namespace>:*`).
    #[default]
    AllowSameNamespace,
    /// Any subject with a valid token for the channel.
    AllowAll,
    /// Nobody.
    DenyAll,
}

/// How Knative objects are mapped: with `senders`, the senders' OIDC tokens are checked and
/// EventPolicies enforced, under that default mode (the server's `--oidc-issuer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapOptions {
    pub senders: Option<AuthorizationMode>,
}
