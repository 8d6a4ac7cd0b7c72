//! Who may send: EventPolicies -> each channel's [`Senders`], as Knative applies them
//! (docs/knative.md, "Who may send").
//!
//! Knative's rules (knative/eventing `pkg/auth/verifier.go`, `pkg/auth/event_policy.go`): with
//! OIDC authentication on, every request needs a token for the channel's audience; the
//! EventPolicies that apply to the channel (`spec.to` empty: every resource of the policy's
//! namespace; a `ref`: that resource by group, kind and name; a `selector`: by group, kind and
//! labels) allow the subjects of their `status.from` (`spec.from` as Knative resolved it),
//! each exact or, ending in `*`, a prefix, compared without case; any applying policy may
//! allow. A channel no policy applies to falls back to the default authorization mode.

use super::{dig, text, Group, KObject, Report};
use crate::model::{Allowed, AuthorizationMode, Problem, Senders};
use serde_json::Value;

const SERVICE_ACCOUNT: &str = "system:serviceaccount";

/// Each channel's senders, by channel name; a channel that has a problem instead (no
/// audience, a policy fanout cannot enforce) is left out and the problem charged to it.
pub(super) fn senders(
    groups: &[Group],
    policies: &[KObject],
    mode: AuthorizationMode,
    report: &mut Report,
) -> Vec<(String, Senders)> {
    let mut out = Vec::new();
    let mut used = vec![false; policies.len()];
    for group in groups {
        let mut applying = Vec::new();
        for (policy, used) in policies.iter().zip(used.iter_mut()) {
            match applies_to_group(policy, group) {
                Ok(true) => {
                    *used = true;
                    applying.push(policy);
                }
                Ok(false) => {}
                Err(problem) => {
                    *used = true;
                    report.channel(&group.name, problem);
                }
            }
        }
        let allowed = allowed(group, &applying, mode, report);
        match (audience(group), allowed) {
            (Some(audience), Some(allowed)) => {
                out.push((group.name.clone(), Senders { audience, allowed }))
            }
            (None, _) => report.channel(
                &group.name,
                Problem::new(
                    &group.primary.label,
                    "status.address.audience",
                    "missing: with OIDC authentication a channel's tokens are for its \
                     audience, and without one a token for this channel could not be told \
                     from another's",
                ),
            ),
            (Some(_), None) => {}
        }
    }
    for (policy, _) in policies.iter().zip(used).filter(|(_, used)| !used) {
        report.warn(
            None,
            Problem::new(
                &policy.label,
                "spec.to",
                "applies to none of the channels of the source; ignored",
            ),
        );
    }
    out
}

/// The subjects allowed to send to `group`; `None` when a policy cannot be enforced (the
/// problem is charged to the channel).
fn allowed(
    group: &Group,
    applying: &[&KObject],
    mode: AuthorizationMode,
    report: &mut Report,
) -> Option<Allowed> {
    if applying.is_empty() {
        return Some(match mode {
            AuthorizationMode::AllowAll => Allowed::Any,
            AuthorizationMode::DenyAll => Allowed::Subjects(Vec::new()),
            AuthorizationMode::AllowSameNamespace => Allowed::Subjects(vec![format!(
                "{SERVICE_ACCOUNT}:{}:*",
                group.primary.namespace
            )]),
        });
    }
    let mut subjects = Vec::new();
    let mut ok = true;
    let mut sorted = applying.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    for policy in sorted {
        if policy
            .at(&["spec", "filters"])
            .is_some_and(|f| f.as_array().is_none_or(|a| !a.is_empty()))
        {
            ok = false;
            let message = "Envoy's rbac cannot read an event's attributes: a sender allowed \
                           only for some events would be allowed for all. Drop the filters, \
                           or keep this channel on Knative";
            report.channel(
                &group.name,
                Problem::new(&policy.label, "spec.filters", message),
            );
        }
        match policy_subjects(policy) {
            Ok(found) => subjects.extend(found),
            Err(problem) => {
                ok = false;
                report.channel(&group.name, problem);
            }
        }
    }
    subjects.dedup();
    ok.then_some(Allowed::Subjects(subjects))
}

/// The channel's audience: the first `status.address.audience` of its members.
fn audience(group: &Group) -> Option<String> {
    group
        .members
        .iter()
        .find_map(|m| text(&m.doc, &["status", "address", "audience"]))
}

fn applies_to_group(policy: &KObject, group: &Group) -> Result<bool, Problem> {
    for member in &group.members {
        if applies(policy, member)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether `policy` applies to the channel object `member`.
fn applies(policy: &KObject, member: &KObject) -> Result<bool, Problem> {
    if policy.namespace != member.namespace {
        return Ok(false);
    }
    let to = match policy.at(&["spec", "to"]) {
        None | Some(Value::Null) => return Ok(true),
        Some(Value::Array(to)) if to.is_empty() => return Ok(true),
        Some(Value::Array(to)) => to,
        Some(_) => return Err(Problem::new(&policy.label, "spec.to", "is not a list")),
    };
    let same = |a: Option<String>, b: &str| a.unwrap_or_default().eq_ignore_ascii_case(b);
    let group_of = |v: &Value| {
        text(v, &["apiVersion"]).map(|a| a.rsplit_once('/').map_or("", |(g, _)| g).to_owned())
    };
    for (i, entry) in to.iter().enumerate() {
        if let Some(reference) = entry.get("ref").filter(|r| r.is_object()) {
            if same(text(reference, &["name"]), &member.name)
                && same(group_of(reference), &member.group)
                && same(text(reference, &["kind"]), &member.kind)
            {
                return Ok(true);
            }
        }
        if let Some(selector) = entry.get("selector").filter(|s| s.is_object()) {
            if same(group_of(selector), &member.group)
                && same(text(selector, &["kind"]), &member.kind)
            {
                let labels = member.at(&["metadata", "labels"]);
                let field = format!("spec.to[{i}].selector");
                if selector_matches(selector, labels).map_err(|(at, why)| {
                    Problem::new(&policy.label, &format!("{field}{at}"), why)
                })? {
                    return Ok(true);
                }
            }
        }
    }
    Ok(false)
}

/// A Kubernetes label selector (`matchLabels`, `matchExpressions`) against `labels`; the
/// error names the field under the selector and says why.
pub(super) fn selector_matches(
    selector: &Value,
    labels: Option<&Value>,
) -> Result<bool, (String, String)> {
    let label = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
    if let Some(Value::Object(wanted)) = selector.get("matchLabels") {
        if wanted.iter().any(|(k, v)| label(k) != v.as_str()) {
            return Ok(false);
        }
    }
    let expressions = selector
        .get("matchExpressions")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    for (i, expression) in expressions.iter().enumerate() {
        let key = text(expression, &["key"]).unwrap_or_default();
        let values: Vec<&str> = dig(expression, &["values"])
            .and_then(Value::as_array)
            .map(|v| v.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let found = label(&key);
        let ok = match text(expression, &["operator"]).as_deref() {
            Some("In") => found.is_some_and(|f| values.contains(&f)),
            Some("NotIn") => found.is_none_or(|f| !values.contains(&f)),
            Some("Exists") => found.is_some(),
            Some("DoesNotExist") => found.is_none(),
            other => {
                return Err((
                    format!(".matchExpressions[{i}].operator"),
                    format!("{other:?} is not a selector operator"),
                ))
            }
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The subjects `policy` allows: `status.from` (what Knative resolved `spec.from` to), else
/// the `sub`s and ServiceAccount refs of `spec.from`; an error when only Knative could
/// resolve them.
fn policy_subjects(policy: &KObject) -> Result<Vec<String>, Problem> {
    if let Some(Value::Array(resolved)) = policy.at(&["status", "from"]) {
        if !resolved.is_empty() {
            return Ok(resolved
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect());
        }
    }
    let from = policy
        .at(&["spec", "from"])
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let mut subjects = Vec::new();
    for (i, entry) in from.iter().enumerate() {
        if let Some(sub) = text(entry, &["sub"]) {
            subjects.push(sub);
            continue;
        }
        let Some(reference) = entry.get("ref").filter(|r| r.is_object()) else {
            let field = format!("spec.from[{i}]");
            return Err(Problem::new(
                &policy.label,
                &field,
                "neither a ref nor a sub",
            ));
        };
        let kind = text(reference, &["kind"]).unwrap_or_default();
        let namespace = text(reference, &["namespace"]).unwrap_or(policy.namespace.clone());
        let name = text(reference, &["name"]).unwrap_or_default();
        if kind == "ServiceAccount" && !name.is_empty() {
            subjects.push(format!("{SERVICE_ACCOUNT}:{namespace}:{name}"));
            continue;
        }
        let message = format!(
            "{kind} {namespace}/{name}: only Knative can tell its OIDC subject, and \
             status.from is empty: export the policy once Knative has resolved it \
             (status.from), or name the subject with `sub`"
        );
        return Err(Problem::new(
            &policy.label,
            &format!("spec.from[{i}].ref"),
            message,
        ));
    }
    Ok(subjects)
}

#[cfg(test)]
mod tests {
    use crate::knative::map;
    use crate::model::{Allowed, AuthorizationMode, MapOptions, Senders, Snapshot};
    use serde_json::{json, Value};

    fn channel(name: &str, labels: Value) -> Value {
        json!({
            "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
            "metadata": { "name": name, "namespace": "shop", "labels": labels },
            "spec": { "subscribers": [{ "subscriberUri": "http://a.example/" }] },
            "status": { "address": {
                "url": format!("http://{name}-kn-channel.shop.svc.cluster.local"),
                "audience": format!("messaging.knative.dev/inmemorychannel/shop/{name}") } }
        })
    }

    fn policy(name: &str, spec: Value, status: Value) -> Value {
        json!({
            "apiVersion": "eventing.knative.dev/v1alpha1", "kind": "EventPolicy",
            "metadata": { "name": name, "namespace": "shop" },
            "spec": spec, "status": status
        })
    }

    fn with_oidc(mode: AuthorizationMode, documents: Vec<Value>) -> Snapshot {
        let options = MapOptions {
            senders: Some(mode),
        };
        map(&options, documents)
    }

    fn allowed(snapshot: &Snapshot, channel: &str) -> Option<Allowed> {
        let mapping = &snapshot.channels[channel];
        assert!(mapping.problems.is_empty(), "{:?}", mapping.problems);
        mapping.spec.senders.as_ref().map(|s| s.allowed.clone())
    }

    fn subjects(list: &[&str]) -> Option<Allowed> {
        Some(Allowed::Subjects(
            list.iter().map(|s| (*s).to_owned()).collect(),
        ))
    }

    #[test]
    fn policies_by_ref_and_selector_allow_their_subjects() {
        let by_ref = policy(
            "orders-producer",
            json!({ "to": [{ "ref": { "apiVersion": "messaging.knative.dev/v1",
                                      "kind": "InMemoryChannel", "name": "orders" } }],
                    "from": [{ "ref": { "apiVersion": "sources.knative.dev/v1",
                                        "kind": "ApiServerSource", "name": "src" } }] }),
            json!({ "from": ["system:serviceaccount:shop:src-oidc"] }),
        );
        let by_labels = policy(
            "partners",
            json!({ "to": [{ "selector": { "apiVersion": "messaging.knative.dev/v1",
                                           "kind": "InMemoryChannel",
                                           "matchLabels": { "team": "shop" },
                                           "matchExpressions": [{ "key": "tier", "operator": "NotIn",
                                                                   "values": ["internal"] }] } }],
                    "from": [{ "sub": "system:serviceaccount:partners:*" },
                             { "ref": { "kind": "ServiceAccount", "name": "ledger" } }] }),
            json!({}),
        );
        let snapshot = with_oidc(
            AuthorizationMode::AllowSameNamespace,
            vec![
                channel("orders", json!({ "team": "shop" })),
                channel("internal", json!({ "team": "shop", "tier": "internal" })),
                channel("audit", json!({})),
                by_ref,
                by_labels,
            ],
        );
        assert_eq!(
            allowed(&snapshot, "shop/orders"),
            subjects(&[
                "system:serviceaccount:shop:src-oidc",
                "system:serviceaccount:partners:*",
                "system:serviceaccount:shop:ledger"
            ])
        );
        // No policy applies: the default mode, allow-same-namespace.
        assert_eq!(
            allowed(&snapshot, "shop/internal"),
            subjects(&["system:serviceaccount:shop:*"])
        );
        assert_eq!(
            snapshot.channels["shop/audit"].spec.senders,
            Some(Senders {
                audience: "messaging.knative.dev/inmemorychannel/shop/audit".into(),
                allowed: Allowed::Subjects(vec!["system:serviceaccount:shop:*".into()]),
            })
        );
        assert!(snapshot.warnings.is_empty(), "{:?}", snapshot.warnings);
    }

    #[test]
    fn the_default_mode_decides_for_a_channel_no_policy_applies_to() {
        let one = || vec![channel("orders", json!({}))];
        let all = with_oidc(AuthorizationMode::AllowAll, one());
        assert_eq!(allowed(&all, "shop/orders"), Some(Allowed::Any));
        let none = with_oidc(AuthorizationMode::DenyAll, one());
        assert_eq!(allowed(&none, "shop/orders"), subjects(&[]));
        // Without OIDC nothing is checked.
        assert_eq!(
            allowed(&map(&MapOptions::default(), one()), "shop/orders"),
            None
        );
    }

    #[test]
    fn what_cannot_be_enforced_is_a_problem_of_the_channel() {
        let unresolved = policy(
            "unresolved",
            json!({ "to": [{ "ref": { "apiVersion": "messaging.knative.dev/v1",
                                      "kind": "InMemoryChannel", "name": "a" } }],
                    "from": [{ "ref": { "apiVersion": "sources.knative.dev/v1",
                                        "kind": "PingSource", "name": "p" } }] }),
            json!({}),
        );
        let filtered = policy(
            "filtered",
            json!({ "to": [{ "ref": { "apiVersion": "messaging.knative.dev/v1",
                                      "kind": "InMemoryChannel", "name": "b" } }],
                    "from": [{ "sub": "x" }], "filters": [{ "exact": { "type": "t" } }] }),
            json!({}),
        );
        let bad_operator = policy(
            "bad-operator",
            json!({ "to": [{ "selector": { "apiVersion": "messaging.knative.dev/v1",
                                           "kind": "InMemoryChannel",
                                           "matchExpressions": [{ "key": "k", "operator": "Has" }] } }],
                    "from": [{ "sub": "x" }] }),
            json!({}),
        );
        let mut no_audience = channel("d", json!({}));
        no_audience["status"]["address"]
            .as_object_mut()
            .unwrap()
            .remove("audience");
        let nowhere = policy(
            "nowhere",
            json!({ "to": [{ "ref": { "apiVersion": "messaging.knative.dev/v1",
                                      "kind": "InMemoryChannel", "name": "gone" } }] }),
            json!({}),
        );
        let snapshot = with_oidc(
            AuthorizationMode::AllowSameNamespace,
            vec![
                channel("a", json!({})),
                channel("b", json!({})),
                no_audience,
                unresolved,
                filtered,
                bad_operator,
                nowhere,
            ],
        );
        let fields = |name: &str| -> Vec<(String, String)> {
            let mapping = &snapshot.channels[name];
            assert_eq!(mapping.spec.senders, None, "{name}");
            mapping
                .problems
                .iter()
                .map(|p| (p.object.clone(), p.field.clone()))
                .collect()
        };
        let f = |o: &str, p: &str| (o.to_owned(), p.to_owned());
        assert!(fields("shop/a").contains(&f("EventPolicy shop/unresolved", "spec.from[0].ref")));
        assert!(fields("shop/b").contains(&f("EventPolicy shop/filtered", "spec.filters")));
        assert!(fields("shop/d").contains(&f(
            "EventPolicy shop/bad-operator",
            "spec.to[0].selector.matchExpressions[0].operator"
        )));
        assert!(fields("shop/d").contains(&f("InMemoryChannel shop/d", "status.address.audience")));
        assert_eq!(snapshot.warnings.len(), 1, "{:?}", snapshot.warnings);
        assert_eq!(snapshot.warnings[0].object, "EventPolicy shop/nowhere");
    }

    #[test]
    fn without_oidc_a_policy_is_a_problem_of_each_channel_of_its_namespace() {
        let snapshot = map(
            &MapOptions::default(),
            vec![
                channel("a", json!({})),
                policy("p", json!({ "from": [{ "sub": "x" }] }), json!({})),
            ],
        );
        let problems = &snapshot.channels["shop/a"].problems;
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].message.contains("--oidc-issuer"));
        // The audience is a warning: senders' tokens are not checked.
        let warnings = &snapshot.channels["shop/a"].warnings;
        assert_eq!(warnings[0].field, "status.address.audience");
    }
}
