//! What the mapping serves differently from Knative, said as warnings (the channel is
//! served), by the server and by `fanout-control render` alike.

use super::{text, Report, Source};
use crate::model::Problem;
use serde_json::Value;

fn warn(report: &mut Report, source: &Source, field: &str, message: String) {
    report.warn(
        Some(source.channel),
        Problem::new(source.object, field, message),
    );
}

/// An OIDC audience of a receiver (`subscriberAudience`, `deadLetterSink.audience`, ...).
pub(super) fn audience(report: &mut Report, source: &Source, field: &str, value: Option<String>) {
    if let Some(value) = value {
        let message = format!(
            "OIDC audience {value:?}: fanout sends no OIDC token; the receiver must accept \
             events without one"
        );
        warn(report, source, field, message);
    }
}

/// An `auth` with the service account(s) Knative's dispatcher would get tokens for.
pub(super) fn auth(report: &mut Report, source: &Source, field: &str, auth: Option<&Value>) {
    let account = auth.and_then(|a| {
        a.get("serviceAccountName")
            .or_else(|| a.get("serviceAccountNames"))
    });
    if let Some(account) = account.filter(|a| !a.is_null()) {
        let message = format!("OIDC service account {account}: fanout sends no OIDC token");
        warn(report, source, field, message);
    }
}

/// Every audience and `auth` of a subscriber entry of a channel's `spec.subscribers`.
pub(super) fn subscriber_entry(report: &mut Report, source: &Source, at: &str, entry: &Value) {
    for name in ["subscriberAudience", "replyAudience"] {
        audience(
            report,
            source,
            &format!("{at}.{name}"),
            text(entry, &[name]),
        );
    }
    auth(report, source, &format!("{at}.auth"), entry.get("auth"));
}

/// Every audience and `auth` of a Subscription (as Knative resolved it, else its spec).
pub(super) fn subscription(report: &mut Report, source: &Source, doc: &Value) {
    let physical = "status.physicalSubscription";
    for role in ["subscriber", "reply"] {
        let resolved = text(
            doc,
            &["status", "physicalSubscription", &format!("{role}Audience")],
        );
        match resolved {
            Some(value) => {
                let field = format!("{physical}.{role}Audience");
                audience(report, source, &field, Some(value));
            }
            None => {
                let value = text(doc, &["spec", role, "audience"]);
                audience(report, source, &format!("spec.{role}.audience"), value);
            }
        }
    }
    let status_auth = doc.get("status").and_then(|s| s.get("auth"));
    auth(report, source, "status.auth", status_auth);
}

/// The backoff fields fanout cannot carry over as written (with `retry` > 0): a policy
/// without a delay or the other way round, and a `retryAfterMax` below the longest backoff.
pub(super) fn backoff(
    report: &mut Report,
    source: &Source,
    at: &str,
    (policy, delay, retry_after_max): (bool, bool, Option<u32>),
    longest: u32,
) {
    if policy != delay {
        let (given, missing) = if policy {
            ("backoffPolicy", "backoffDelay")
        } else {
            ("backoffDelay", "backoffPolicy")
        };
        let message = format!(
            "without {missing}, Knative's dispatcher does not wait between retries; neither \
             does fanout (backoff_delay_ms 0)"
        );
        warn(report, source, &format!("{at}.{given}"), message);
    }
    let field = format!("{at}.retryAfterMax");
    match retry_after_max {
        Some(0) => {
            let message = format!(
                "PT0S (ignore Retry-After) has no equivalent: fanout honours Retry-After, up \
                 to backoff_max_ms ({longest} ms, the longest backoff)"
            );
            warn(report, source, &field, message);
        }
        Some(cap) if cap < longest => {
            let message = format!(
                "{cap} ms is less than the longest backoff ({longest} ms) and has no \
                 equivalent: fanout's one cap on every wait, backoff_max_ms, cannot cut \
                 Knative's backoff, so it is {longest} ms and a Retry-After can make fanout \
                 wait up to that"
            );
            warn(report, source, &field, message);
        }
        _ => {}
    }
}
