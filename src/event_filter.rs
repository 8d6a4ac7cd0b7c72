//! Subscription filters: which events a subscriber wants, in the dialect of Knative Trigger
//! filters, compiled once at configure time into a [`Filter`] that matches an event's
//! [`Attributes`].
//!
//! ```json
//! "filters": [
//!   { "exact":  { "type": "com.example.order.created" } },
//!   { "prefix": { "source": "/orders/" } },
//!   { "suffix": { "subject": ".pdf" } },
//!   { "any": [ { "exact": { "type": "a" } }, { "exact": { "type": "b" } } ] },
//!   { "all": [ ... ] },
//!   { "not": { "exact": { "extension1": "x" } } }
//! ]
//! ```
//! A list means all of its filters. The older `"filter": {"attributes": {"type": "t"}}` form
//! is exact matching of every named attribute, an empty value meaning any value.
//!
//! Matching is case-sensitive on values. An attribute the event does not have never matches
//! `exact`, `prefix` or `suffix` (so `not` of one of those does match it). A request that is
//! not a CloudEvent has no attributes at all: it reaches only subscribers without a filter.
//!
//! This module neither reads requests (see [`crate::cloudevents`]) nor knows proxy-wasm.

use std::fmt;

use crate::cloudevents::Attributes;
use crate::json::Node;

/// A compiled filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Filter {
    Exact {
        attribute: String,
        value: String,
    },
    Prefix {
        attribute: String,
        value: String,
    },
    Suffix {
        attribute: String,
        value: String,
    },
    /// At least one matches.
    Any(Vec<Filter>),
    /// Every one matches.
    All(Vec<Filter>),
    Not(Box<Filter>),
}

impl Filter {
    pub fn matches(&self, event: &Attributes) -> bool {
        match self {
            Filter::Exact { attribute, value } => event.get(attribute) == Some(value.as_str()),
            Filter::Prefix { attribute, value } => event
                .get(attribute)
                .is_some_and(|v| v.starts_with(value.as_str())),
            Filter::Suffix { attribute, value } => event
                .get(attribute)
                .is_some_and(|v| v.ends_with(value.as_str())),
            Filter::Any(filters) => filters.iter().any(|f| f.matches(event)),
            Filter::All(filters) => filters.iter().all(|f| f.matches(event)),
            Filter::Not(filter) => !filter.matches(event),
        }
    }
}

impl Filter {
    /// Whether it reads the attribute `name` (some `exact`, `prefix` or `suffix` in it names
    /// it): the attributes a request must let fanout read.
    pub fn names(&self, name: &str) -> bool {
        match self {
            Filter::Exact { attribute, .. }
            | Filter::Prefix { attribute, .. }
            | Filter::Suffix { attribute, .. } => attribute == name,
            Filter::Any(filters) | Filter::All(filters) => filters.iter().any(|f| f.names(name)),
            Filter::Not(filter) => filter.names(name),
        }
    }
}

/// Does a subscriber with `filter` (`None`: it has none) want the event? `event` is `None`
/// for a request that is not a CloudEvent.
pub fn accepts(filter: Option<&Filter>, event: Option<&Attributes>) -> bool {
    match (filter, event) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(filter), Some(event)) => filter.matches(event),
    }
}

/// A filter that cannot be compiled. `path` is relative to the subscriber
/// (`filters[2].exact`); the config prefixes it with the subscriber's own path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterError {
    pub path: String,
    pub message: String,
}

impl FilterError {
    fn new(path: &str, message: impl Into<String>) -> Self {
        FilterError {
            path: path.to_string(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FilterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

const OPERATORS: &str = "exact, prefix, suffix, any, all or not";

/// Compiles a subscriber's `filters` list (all must match). An empty list is no filter.
pub fn compile_list(filters: &[Node]) -> Result<Option<Filter>, FilterError> {
    let mut compiled = Vec::with_capacity(filters.len());
    for (i, value) in filters.iter().enumerate() {
        compiled.push(compile(value, &format!("filters[{i}]"))?);
    }
    Ok(all_of(compiled))
}

/// What a list of filters that must all match compiles to: nothing for an empty list, the
/// filter itself for one.
fn all_of(mut filters: Vec<Filter>) -> Option<Filter> {
    match filters.len() {
        0 => None,
        1 => filters.pop(),
        _ => Some(Filter::All(filters)),
    }
}

/// Compiles the older `filter: {"attributes": {...}}` form. Attributes with an empty value
/// match anything; with none left, it is no filter at all.
pub fn compile_legacy(filter: &Node) -> Result<Option<Filter>, FilterError> {
    let at = "filter";
    let object = filter.as_object().ok_or_else(|| {
        FilterError::new(
            at,
            "must be an object such as {\"attributes\": {\"type\": \"com.example.order.created\"}}",
        )
    })?;
    if let Some((other, _)) = object.iter().find(|(k, _)| *k != "attributes") {
        return Err(FilterError::new(
            &format!("{at}.{other}"),
            "unknown field, expected `attributes` (or use `filters` for the full dialect)",
        ));
    }
    let Some((_, attributes)) = object.first() else {
        return Ok(None);
    };
    let at = "filter.attributes";
    let attributes = attributes.as_object().ok_or_else(|| {
        FilterError::new(
            at,
            "must be an object of attribute names and values, e.g. {\"type\": \"t\"}",
        )
    })?;
    let mut exact = Vec::with_capacity(attributes.len());
    for (name, value) in attributes {
        let path = format!("{at}.{name}");
        check_attribute_name(name, &path)?;
        let value = string_value(value, &path)?;
        if !value.is_empty() {
            exact.push(Filter::Exact {
                attribute: name.to_string(),
                value: value.to_string(),
            });
        }
    }
    Ok(all_of(exact))
}

fn compile(value: &Node, at: &str) -> Result<Filter, FilterError> {
    let (operator, operand) = operator(value, at)?;
    let at = format!("{at}.{operator}");
    match operator {
        "exact" | "prefix" | "suffix" => {
            let (attribute, value) = single_attribute(operand, &at)?;
            Ok(match operator {
                "exact" => Filter::Exact { attribute, value },
                "prefix" => Filter::Prefix { attribute, value },
                _ => Filter::Suffix { attribute, value },
            })
        }
        "any" | "all" => {
            let filters = compile_operands(operand, &at)?;
            Ok(if operator == "any" {
                Filter::Any(filters)
            } else {
                Filter::All(filters)
            })
        }
        "not" => Ok(Filter::Not(Box::new(compile(operand, &at)?))),
        "cesql" => Err(FilterError::new(
            &at,
            format!("CloudEvents SQL is not supported; use {OPERATORS}"),
        )),
        other => Err(FilterError::new(
            &at,
            format!("unknown operator \"{other}\": use {OPERATORS}"),
        )),
    }
}

/// A filter object's one operator and its operand.
fn operator<'n>(value: &'n Node, at: &str) -> Result<(&'n str, &'n Node), FilterError> {
    let object = value.as_object().ok_or_else(|| {
        FilterError::new(
            at,
            format!("must be an object with one operator ({OPERATORS}), e.g. {{\"exact\": {{\"type\": \"t\"}}}}"),
        )
    })?;
    if let [(operator, operand)] = object[..] {
        return Ok((operator, operand));
    }
    let names: Vec<&str> = object.iter().map(|(name, _)| *name).collect();
    Err(FilterError::new(
        at,
        format!(
            "must have exactly one operator ({OPERATORS}), got {}",
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        ),
    ))
}

/// The operand of `any`/`all`: a non-empty list of filters.
fn compile_operands(operand: &Node, at: &str) -> Result<Vec<Filter>, FilterError> {
    let list = operand
        .as_array()
        .ok_or_else(|| FilterError::new(at, "must be a list of filters"))?;
    if list.is_empty() {
        return Err(FilterError::new(at, "must list at least one filter"));
    }
    list.iter()
        .enumerate()
        .map(|(i, f)| compile(f, &format!("{at}[{i}]")))
        .collect()
}

/// The operand of `exact`/`prefix`/`suffix`: an object with one attribute and its value.
fn single_attribute(operand: &Node, at: &str) -> Result<(String, String), FilterError> {
    let object = operand.as_object().ok_or_else(|| {
        FilterError::new(
            at,
            "must be an object naming one attribute, e.g. {\"type\": \"com.example.order.created\"}",
        )
    })?;
    let mut entries = object.iter();
    let (Some((name, value)), None) = (entries.next(), entries.next()) else {
        return Err(FilterError::new(
            at,
            format!(
                "must name exactly one attribute (got {}); combine several with `all` or a \
                 list",
                object.len()
            ),
        ));
    };
    let path = format!("{at}.{name}");
    check_attribute_name(name, &path)?;
    Ok((name.to_string(), string_value(value, &path)?.to_string()))
}

/// CloudEvents attribute names are lower-case letters and digits; headers reach the filter
/// lower-cased, so `Type` could never match anything.
fn check_attribute_name(name: &str, path: &str) -> Result<(), FilterError> {
    if name.is_empty() {
        return Err(FilterError::new(
            path,
            "the attribute name must not be empty",
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(FilterError::new(
            path,
            format!(
                "\"{name}\" is not a CloudEvents attribute name (lower-case letters and digits, \
                 e.g. \"type\", \"source\", \"myextension\")"
            ),
        ));
    }
    Ok(())
}

fn string_value<'v>(value: &'v Node, path: &str) -> Result<&'v str, FilterError> {
    value.as_str().ok_or_else(|| {
        // Numbers and booleans are compared in their text form: show the value to write
        // (a float as serde_json writes it).
        let example = match value {
            Node::Unsigned(n) => n.to_string(),
            Node::Signed(n) => n.to_string(),
            Node::Float(n) => {
                serde_json::Number::from_f64(*n).map_or("value".to_string(), |n| n.to_string())
            }
            Node::Bool(b) => b.to_string(),
            _ => "value".to_string(),
        };
        FilterError::new(
            path,
            format!("must be a string (attribute values are compared as text, e.g. \"{example}\")"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(json: &str) -> Option<Filter> {
        let values: Vec<Node> = serde_json::from_str(json).unwrap();
        compile_list(&values).unwrap()
    }

    fn filter(json: &str) -> Filter {
        list(&format!("[{json}]")).unwrap()
    }

    #[test]
    fn a_filter_names_the_attributes_its_matches_read() {
        let f = filter(
            r#"{"any": [{"exact": {"type": "a"}},
                        {"all": [{"prefix": {"source": "/"}}, {"not": {"suffix": {"subject": "x"}}}]}]}"#,
        );
        for name in ["type", "source", "subject"] {
            assert!(f.names(name), "{name}");
        }
        for name in ["id", "greeting", "datacontenttype", ""] {
            assert!(!f.names(name), "{name}");
        }
    }

    fn list_error(json: &str) -> String {
        let values: Vec<Node> = serde_json::from_str(json).unwrap();
        match compile_list(&values) {
            Ok(f) => panic!("compiled: {json} -> {f:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn event() -> Attributes {
        Attributes::from([
            ("specversion", "1.0"),
            ("type", "com.example.order.created"),
            ("source", "/orders/eu"),
            ("subject", "invoice.pdf"),
            ("id", "1"),
            ("extension1", "x"),
            ("empty", ""),
        ])
    }

    /// (filter, does it match `event()`)
    const OPERATOR_TABLE: &[(&str, bool)] = &[
        (r#"{"exact": {"type": "com.example.order.created"}}"#, true),
        (r#"{"exact": {"type": "com.example.order"}}"#, false),
        (r#"{"exact": {"type": "COM.EXAMPLE.ORDER.CREATED"}}"#, false),
        (r#"{"exact": {"empty": ""}}"#, true),
        (r#"{"prefix": {"source": "/orders/"}}"#, true),
        (r#"{"prefix": {"source": "/orders/eu"}}"#, true),
        (r#"{"prefix": {"source": "/payments/"}}"#, false),
        (r#"{"prefix": {"source": ""}}"#, true),
        (r#"{"suffix": {"subject": ".pdf"}}"#, true),
        (r#"{"suffix": {"subject": ".PDF"}}"#, false),
        (r#"{"suffix": {"subject": "invoice"}}"#, false),
        (r#"{"exact": {"extension1": "x"}}"#, true),
        (
            r#"{"any": [{"exact": {"type": "a"}}, {"exact": {"type": "com.example.order.created"}}]}"#,
            true,
        ),
        (
            r#"{"any": [{"exact": {"type": "a"}}, {"exact": {"type": "b"}}]}"#,
            false,
        ),
        (
            r#"{"all": [{"exact": {"id": "1"}}, {"prefix": {"source": "/orders"}}]}"#,
            true,
        ),
        (
            r#"{"all": [{"exact": {"id": "1"}}, {"prefix": {"source": "/pay"}}]}"#,
            false,
        ),
        (r#"{"not": {"exact": {"extension1": "x"}}}"#, false),
        (r#"{"not": {"exact": {"extension1": "y"}}}"#, true),
        (r#"{"not": {"not": {"exact": {"id": "1"}}}}"#, true),
    ];

    #[test]
    fn every_operator() {
        let event = event();
        for (json, want) in OPERATOR_TABLE {
            assert_eq!(filter(json).matches(&event), *want, "{json}");
        }
    }

    #[test]
    fn nesting() {
        let f = filter(
            r#"{"all": [
                {"any": [{"prefix": {"source": "/payments/"}},
                         {"all": [{"prefix": {"source": "/orders/"}},
                                  {"not": {"suffix": {"subject": ".txt"}}}]}]},
                {"not": {"any": [{"exact": {"type": "a"}}, {"exact": {"type": "b"}}]}}
            ]}"#,
        );
        assert!(f.matches(&event()));
        let mut txt = event();
        txt.insert("subject".into(), "notes.txt".into());
        assert!(!f.matches(&txt));
        let mut b = event();
        b.insert("type".into(), "b".into());
        assert!(!f.matches(&b));
        let mut payments = txt.clone();
        payments.insert("source".into(), "/payments/x".into());
        assert!(f.matches(&payments));
    }

    #[test]
    fn absent_attributes_never_match_exact_prefix_or_suffix() {
        let event = event();
        for json in [
            r#"{"exact": {"missing": ""}}"#,
            r#"{"exact": {"missing": "x"}}"#,
            r#"{"prefix": {"missing": ""}}"#,
            r#"{"suffix": {"missing": ""}}"#,
        ] {
            assert!(!filter(json).matches(&event), "{json}");
            let negated = format!(r#"{{"not": {json}}}"#);
            assert!(filter(&negated).matches(&event), "{negated}");
        }
        // An event with no attributes at all.
        assert!(!filter(r#"{"prefix": {"type": ""}}"#).matches(&Attributes::default()));
    }

    #[test]
    fn a_list_means_all() {
        let f = list(r#"[{"exact": {"id": "1"}}, {"suffix": {"subject": ".pdf"}}]"#).unwrap();
        assert!(f.matches(&event()));
        let f = list(r#"[{"exact": {"id": "1"}}, {"suffix": {"subject": ".doc"}}]"#).unwrap();
        assert!(!f.matches(&event()));
        assert_eq!(list("[]"), None);
    }

    #[test]
    fn accepts_without_filter_anything_with_filter_only_cloudevents() {
        let any_type = filter(r#"{"prefix": {"type": ""}}"#);
        let not_x = filter(r#"{"not": {"exact": {"type": "x"}}}"#);
        let event = event();
        assert!(accepts(None, None));
        assert!(accepts(None, Some(&event)));
        assert!(!accepts(Some(&any_type), None));
        assert!(!accepts(Some(&not_x), None));
        assert!(accepts(Some(&any_type), Some(&event)));
        assert!(accepts(Some(&not_x), Some(&event)));
    }

    fn legacy(json: &str) -> Result<Option<Filter>, FilterError> {
        compile_legacy(&serde_json::from_str(json).unwrap())
    }

    /// A name given twice in an object keeps its last value, as serde_json's `Value` (which
    /// the filters were compiled from before) kept it.
    #[test]
    fn a_repeated_name_keeps_its_last_value() {
        let exact = |attribute: &str, value: &str| Filter::Exact {
            attribute: attribute.to_string(),
            value: value.to_string(),
        };
        assert_eq!(
            filter(r#"{"exact": {"type": "a"}, "exact": {"type": "b"}}"#),
            exact("type", "b")
        );
        assert_eq!(
            filter(r#"{"prefix": {"type": "a", "type": "b"}}"#),
            Filter::Prefix {
                attribute: "type".to_string(),
                value: "b".to_string()
            }
        );
        assert_eq!(
            legacy(r#"{"attributes": {"type": "a", "id": "1", "type": "b"}}"#),
            Ok(Some(Filter::All(vec![
                exact("id", "1"),
                exact("type", "b")
            ])))
        );
        assert_eq!(
            legacy(r#"{"attributes": {"type": "a", "type": ""}}"#),
            Ok(None)
        );
        assert!(list_error(
            r#"[{"exact": {"type": "a"}, "not": {"exact": {"type": "b"}}, "exact": {"type": "c"}}]"#
        )
        .contains("got not, exact"));
    }

    #[test]
    fn legacy_attributes_are_exact_with_empty_meaning_any() {
        let f = legacy(r#"{"attributes": {"type": "com.example.order.created", "source": ""}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            f,
            Filter::Exact {
                attribute: "type".into(),
                value: "com.example.order.created".into()
            }
        );
        let f = legacy(r#"{"attributes": {"type": "com.example.order.created", "id": "1"}}"#)
            .unwrap()
            .unwrap();
        assert!(f.matches(&event()));
        let f = legacy(r#"{"attributes": {"type": "com.example.order.created", "id": "2"}}"#)
            .unwrap()
            .unwrap();
        assert!(!f.matches(&event()));
        // Nothing left to constrain: no filter, which also takes non-CloudEvents.
        assert_eq!(legacy(r#"{"attributes": {"type": ""}}"#), Ok(None));
        assert_eq!(legacy(r#"{"attributes": {}}"#), Ok(None));
        assert_eq!(legacy(r#"{}"#), Ok(None));
    }

    #[test]
    fn rejections_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (
                r#"[{"exact": {"type": "a"}}, {"exact": {"type": "a"}}, {"exact": {"type": "a", "source": "b"}}]"#,
                "filters[2].exact: must name exactly one attribute (got 2)",
            ),
            (
                r#"[{"prefix": {}}]"#,
                "filters[0].prefix: must name exactly one attribute (got 0)",
            ),
            (
                r#"[{"suffix": "x"}]"#,
                "filters[0].suffix: must be an object naming one attribute",
            ),
            (
                r#"[{"exat": {"type": "a"}}]"#,
                "filters[0].exat: unknown operator \"exat\": use exact, prefix, suffix, any, all or not",
            ),
            (
                r#"[{"cesql": "type = 'a'"}]"#,
                "filters[0].cesql: CloudEvents SQL is not supported",
            ),
            (
                r#"[{"exact": {"": "a"}}]"#,
                "filters[0].exact.: the attribute name must not be empty",
            ),
            (
                r#"[{"exact": {"Type": "a"}}]"#,
                "filters[0].exact.Type: \"Type\" is not a CloudEvents attribute name",
            ),
            (
                r#"[{"exact": {"ce-type": "a"}}]"#,
                "filters[0].exact.ce-type: \"ce-type\" is not a CloudEvents attribute name",
            ),
            (
                r#"[{"exact": {"sequence": 5}}]"#,
                "filters[0].exact.sequence: must be a string (attribute values are compared as text, e.g. \"5\")",
            ),
            (r#"[{}]"#, "filters[0]: must have exactly one operator (exact, prefix, suffix, any, all or not), got none"),
            (
                r#"[{"exact": {"type": "a"}, "prefix": {"source": "b"}}]"#,
                "filters[0]: must have exactly one operator (exact, prefix, suffix, any, all or not), got exact, prefix",
            ),
            (r#"["type=a"]"#, "filters[0]: must be an object with one operator"),
            (r#"[{"any": []}]"#, "filters[0].any: must list at least one filter"),
            (r#"[{"all": {"exact": {"type": "a"}}}]"#, "filters[0].all: must be a list of filters"),
            (
                r#"[{"any": [{"exact": {"type": "a"}}, {"not": {"bogus": {}}}]}]"#,
                "filters[0].any[1].not.bogus: unknown operator",
            ),
            (
                r#"[{"all": [{"not": {"prefix": {"source": "a", "id": "b"}}}]}]"#,
                "filters[0].all[0].not.prefix: must name exactly one attribute",
            ),
        ];
        for (json, want) in cases {
            let got = list_error(json);
            assert!(
                got.starts_with(want),
                "{json}\n  gave: {got}\n  want: {want}..."
            );
        }
        let legacy_cases: &[(&str, &str)] = &[
            (
                r#"{"attributes": {"": "x"}}"#,
                "filter.attributes.: the attribute name must not be empty",
            ),
            (
                r#"{"attributes": {"type": 1}}"#,
                "filter.attributes.type: must be a string",
            ),
            (
                r#"{"attributes": ["type"]}"#,
                "filter.attributes: must be an object",
            ),
            (
                r#"{"attribute": {"type": "a"}}"#,
                "filter.attribute: unknown field, expected `attributes`",
            ),
            (r#"[]"#, "filter: must be an object"),
        ];
        for (json, want) in legacy_cases {
            let got = legacy(json).unwrap_err().to_string();
            assert!(
                got.starts_with(want),
                "{json}\n  gave: {got}\n  want: {want}..."
            );
        }
    }
}
