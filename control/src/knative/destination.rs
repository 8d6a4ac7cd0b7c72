//! Why a Knative Destination (`{ref, uri, CACerts, audience}`) gives fanout no URI to call:
//! fanout calls what Knative resolved (from a status) or an absolute `uri`, and cannot
//! resolve a `ref` itself.

use serde_json::Value;

/// The field and the message for the Destination at `field` of an object in `namespace`,
/// which Knative would have resolved into `resolved_field`.
pub(super) fn unresolved(
    destination: Option<&Value>,
    namespace: &str,
    field: &str,
    resolved_field: &str,
) -> (String, String) {
    let Some(destination) = destination.filter(|d| d.is_object()) else {
        let shown = destination.map_or("null".to_owned(), Value::to_string);
        return (
            field.to_owned(),
            format!("{shown} is not a Destination ({{ref, uri}})"),
        );
    };
    fn text(v: Option<&Value>) -> Option<&str> {
        v.and_then(Value::as_str).filter(|s| !s.is_empty())
    }
    if let Some(reference) = destination.get("ref").filter(|r| r.is_object()) {
        let kind = text(reference.get("kind")).unwrap_or("?");
        let ns = text(reference.get("namespace")).unwrap_or(namespace);
        let name = text(reference.get("name")).unwrap_or("?");
        let message = format!(
            "{kind} {ns}/{name} is not resolved to a URI ({resolved_field} is empty): fanout \
             cannot resolve references; let Knative resolve it first, or write an absolute uri"
        );
        return (format!("{field}.ref"), message);
    }
    match text(destination.get("uri")) {
        Some(uri) => (
            format!("{field}.uri"),
            format!("'{uri}' is relative and there is no ref to resolve it against"),
        ),
        None => (field.to_owned(), "has neither a ref nor a uri".to_owned()),
    }
}
