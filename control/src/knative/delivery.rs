//! Knative's DeliverySpec as the filter's `delivery` and per-call timeout: retries and
//! their backoff, the timeout, the dead letter (as Knative resolved it into the statuses, or
//! its own absolute URI), the format.

use super::objects::{dig, text, Group};
use super::uris::{target, Reply, Source};
use super::{destination, duration, warnings, Report};
use crate::model::{ChannelSpec, Problem};
use fanout::config::{RawDelivery, RawTarget};
use fanout::retry::BackoffPolicy;
use serde_json::{Map, Value};

const DELIVERY_FIELDS: [&str; 7] = [
    "deadLetterSink",
    "retry",
    "timeout",
    "backoffPolicy",
    "backoffDelay",
    "retryAfterMax",
    "format",
];

/// The channel's own `spec.delivery`, for subscribers without one of their own, with its
/// dead letter as Knative resolved it into the channel's status.
pub(super) fn channel_delivery<'a>(group: &'a Group, report: &mut Report) -> Delivery<'a> {
    let member = group
        .members
        .iter()
        .find(|m| m.at(&["spec", "delivery"]).is_some())?;
    let spec = member.at(&["spec", "delivery"])?;
    let source = Source {
        channel: &group.name,
        object: &member.label,
    };
    let dead_letter = resolved_dead_letter(&member.doc, &["status"], &source, report);
    let at = "spec.delivery".to_owned();
    Some((spec, member.label.clone(), at, dead_letter))
}

/// The dead letter Knative resolved into the status object at `path` (`deadLetterSinkUri`,
/// `-CACerts`, `-Audience`).
pub(super) fn resolved_dead_letter(
    doc: &Value,
    path: &[&str],
    source: &Source,
    report: &mut Report,
) -> Option<Reply> {
    let status = dig(doc, path)?;
    let uri = text(status, &["deadLetterSinkUri"])?;
    let at = path.join(".");
    let audience = text(status, &["deadLetterSinkAudience"]);
    warnings::audience(
        report,
        source,
        &format!("{at}.deadLetterSinkAudience"),
        audience,
    );
    let ca = text(status, &["deadLetterSinkCACerts"]);
    Some((uri, format!("{at}.deadLetterSinkUri"), ca))
}

/// A DeliverySpec, the object and field it is written at, and its dead letter as Knative
/// resolved it (URI, field, CA certificates), if it did.
pub(super) type Delivery<'a> = Option<(&'a Value, String, String, Option<Reply>)>;

/// Knative's DeliverySpec -> fanout's `delivery` (`None`: nothing to set) and the per-call
/// timeout.
pub(super) fn map_delivery(
    source: &Source,
    (delivery, at, resolved): (&Value, &str, Option<Reply>),
    spec: &mut ChannelSpec,
    report: &mut Report,
) -> (Option<RawDelivery>, Option<u32>) {
    let mut out = RawDelivery::default();
    let mut problem = |field: &str, message: String| {
        let problem = Problem::new(source.object, &format!("{at}.{field}"), message);
        report.channel(source.channel, problem);
    };
    let Some(fields) = delivery.as_object() else {
        problem("", "is not a DeliverySpec".into());
        return (None, None);
    };
    let checked = check_delivery(fields, &mut problem);
    for (field, message) in &checked.warnings {
        let warning = Problem::new(source.object, &format!("{at}.{field}"), message.clone());
        report.warn(Some(source.channel), warning);
    }
    out.format = checked.format;
    if checked.retry > 0 {
        let (policy, delay, cap) = (checked.policy, checked.delay, checked.retry_after_max);
        let longest = retries(&mut out, checked.retry, policy, delay, cap);
        let given = (policy.is_some(), delay.is_some(), cap);
        warnings::backoff(report, source, at, given, longest);
    }
    let own = || {
        let uri = text(delivery, &["deadLetterSink", "uri"])?;
        let ca = text(delivery, &["deadLetterSink", "CACerts"]);
        Some((uri, format!("{at}.deadLetterSink.uri"), ca))
    };
    if resolved.is_none() {
        let field = format!("{at}.deadLetterSink.audience");
        let audience = text(delivery, &["deadLetterSink", "audience"]);
        warnings::audience(report, source, &field, audience);
    }
    if let Some((uri, field, ca)) = resolved.or_else(own) {
        out.dead_letter = target(source, &uri, &field, ca, spec, report).map(|t| RawTarget {
            timeout_ms: checked.timeout,
            ..t
        });
    } else if delivery.get("deadLetterSink").is_some() {
        unresolved_dead_letter(source, at, delivery, report);
    }
    let set = out != RawDelivery::default();
    (set.then_some(out), checked.timeout)
}

/// A DeliverySpec's `deadLetterSink` that nothing resolved: an error naming where Knative
/// would have resolved it.
fn unresolved_dead_letter(source: &Source, at: &str, delivery: &Value, report: &mut Report) {
    // Where Knative resolves this delivery's sink: a channel's and a Subscription's
    // statuses; a channel's subscriber entry has it resolved already.
    let (kind, namespace) = source
        .object
        .split_once(' ')
        .and_then(|(kind, rest)| rest.split_once('/').map(|(ns, _)| (kind, ns)))
        .unwrap_or(("", "default"));
    let status_path = match (at, kind) {
        ("spec.delivery", "Subscription") => Some("status.physicalSubscription"),
        ("spec.delivery", _) => Some("status"),
        _ => None,
    };
    let resolved_field = status_path.map_or_else(
        || format!("{at}.deadLetterSink.uri"),
        |path| format!("{path}.deadLetterSinkUri"),
    );
    let (field, message) = destination::unresolved(
        delivery.get("deadLetterSink"),
        namespace,
        &format!("{at}.deadLetterSink"),
        &resolved_field,
    );
    report.channel(source.channel, Problem::new(source.object, &field, message));
}

/// A DeliverySpec's fields, checked.
#[derive(Default)]
struct Checked {
    retry: u64,
    timeout: Option<u32>,
    delay: Option<u32>,
    retry_after_max: Option<u32>,
    policy: Option<BackoffPolicy>,
    format: Option<String>,
    /// (field, message): what is carried over other than as Knative has it.
    warnings: Vec<(String, String)>,
}

fn check_delivery(fields: &Map<String, Value>, problem: &mut dyn FnMut(&str, String)) -> Checked {
    for name in fields
        .keys()
        .filter(|n| !DELIVERY_FIELDS.contains(&n.as_str()))
    {
        problem(
            name,
            "not a field of Knative's DeliverySpec that fanout knows".into(),
        );
    }
    let mut checked = Checked::default();
    if let Some(v) = fields.get("retry").filter(|v| !v.is_null()) {
        // The limit is the filter's own; said here at the DeliverySpec's field (the filter
        // refuses more anyway: contract.rs).
        match retry(v) {
            Ok(n) => checked.retry = n,
            Err(message) => problem("retry", message),
        }
    }
    let mut warnings = Vec::new();
    let mut duration = |name: &str, zero: bool| {
        let v = fields.get(name).filter(|v| !v.is_null())?;
        match duration::parse(v, zero) {
            Ok(parsed) => {
                let warning = parsed.unlike_knative(v);
                warnings.extend(warning.map(|message| (name.to_owned(), message)));
                Some(parsed.ms)
            }
            Err(message) => {
                problem(name, message);
                None
            }
        }
    };
    checked.timeout = duration("timeout", false);
    checked.delay = duration("backoffDelay", true);
    checked.retry_after_max = duration("retryAfterMax", true);
    checked.warnings.extend(warnings);
    match fields.get("backoffPolicy") {
        Some(Value::String(p)) if p == "linear" => checked.policy = Some(BackoffPolicy::Linear),
        Some(Value::String(p)) if p == "exponential" => {
            checked.policy = Some(BackoffPolicy::Exponential)
        }
        Some(p) => problem(
            "backoffPolicy",
            format!("{p}: must be linear or exponential"),
        ),
        None => {}
    }
    match fields.get("format") {
        Some(Value::String(f)) if f == "json" || f == "binary" => checked.format = Some(f.clone()),
        Some(f) => problem(
            "format",
            format!("{f}: Knative's formats are json (structured mode) and binary"),
        ),
        None => {}
    }
    checked
}

/// A DeliverySpec's `retry`: a whole number up to the filter's own limit.
fn retry(v: &Value) -> Result<u64, String> {
    let max = fanout::retry::MAX_RETRY;
    match v.as_u64() {
        Some(n) if n > u64::from(max) => Err(format!("{n}: fanout retries at most {max} times")),
        Some(n) => Ok(n),
        None => Err(format!("{v}: must be a whole number, 0 or more")),
    }
}

/// Knative waits delay * 2^(n-1) (exponential) or delay * (n-1) (linear) before retry n;
/// fanout waits delay * 2^n or delay * n: exponential maps with half the delay. Returns the
/// longest backoff (ms).
/// A `retry` past u32 is written as u32::MAX: the filter refuses both, with its own limit.
fn retries(
    out: &mut RawDelivery,
    retry: u64,
    policy: Option<BackoffPolicy>,
    delay: Option<u32>,
    cap: Option<u32>,
) -> u32 {
    out.retry = Some(u32::try_from(retry).unwrap_or(u32::MAX));
    let (delay, longest) = match (policy, delay) {
        (Some(BackoffPolicy::Exponential), Some(d)) => {
            let half = d.div_ceil(2);
            (half, u64::from(half).saturating_mul(1u64 << retry.min(62)))
        }
        (Some(BackoffPolicy::Linear), Some(d)) => (d, u64::from(d).saturating_mul(retry)),
        _ => (0, 0),
    };
    if delay > 0 {
        out.backoff_policy = policy;
    }
    out.backoff_delay_ms = Some(delay);
    let longest = u32::try_from(longest).unwrap_or(u32::MAX);
    out.backoff_max_ms = Some(cap.filter(|c| *c >= longest).unwrap_or(longest));
    longest
}
