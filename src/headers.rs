//! Which request headers travel to subscribers, and which never do.
//!
//! `forward_headers` lists names (`x-request-id`) and prefixes (`ce-*`). Some headers are
//! never forwarded whatever the list says: pseudo-headers, hop-by-hop headers, the original
//! `host` and `content-length` (Envoy sets it from the body it sends). Credentials
//! (`authorization`, `cookie`, `proxy-authorization`) and Envoy's own `x-envoy-*` headers
//! travel only when the list names them exactly: a prefix or `*` never picks them up.

use std::collections::HashSet;

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1), and those
/// Envoy sets itself on every call.
pub const NEVER_FORWARDED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
    "expect",
];

/// Forwarded only when `forward_headers` names them exactly.
pub const SENSITIVE: &[&str] = &["authorization", "cookie", "proxy-authorization"];
const SENSITIVE_PREFIX: &str = "x-envoy-";

#[derive(Debug, Default)]
pub struct HeaderSelector {
    exact: HashSet<String>,
    prefixes: Vec<String>,
}

impl HeaderSelector {
    /// Builds the selector from `forward_headers` entries. An error names the index of the
    /// offending entry and what is wrong with it.
    pub fn new<S: AsRef<str>>(entries: &[S]) -> Result<Self, (usize, String)> {
        let mut selector = HeaderSelector::default();
        for (i, entry) in entries.iter().enumerate() {
            let entry = entry.as_ref().to_ascii_lowercase();
            let (name, is_prefix) = match entry.strip_suffix('*') {
                Some(prefix) => (prefix, true),
                None => (entry.as_str(), false),
            };
            if !is_prefix && name.is_empty() {
                return Err((i, "must not be empty".to_string()));
            }
            if !name.bytes().all(|b| is_token_byte(b) && b != b'*') {
                return Err((
                    i,
                    format!(
                        "\"{entry}\" is not a header name (letters, digits and -, optionally \
                         ending in * for a prefix)"
                    ),
                ));
            }
            if !is_prefix && is_never_forwarded(name) {
                return Err((
                    i,
                    format!(
                        "\"{name}\" is never forwarded: it belongs to one connection or Envoy \
                         sets it on each call"
                    ),
                ));
            }
            if is_prefix {
                selector.prefixes.push(name.to_string());
            } else {
                selector.exact.insert(name.to_string());
            }
        }
        Ok(selector)
    }

    /// Entries that forward credentials or Envoy-internal headers, for a warning at
    /// configure time.
    pub fn sensitive_entries(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .exact
            .iter()
            .map(String::as_str)
            .filter(|name| is_sensitive(name))
            .collect();
        names.sort_unstable();
        names
    }

    /// Whether a request header (lower-case name, as Envoy hands it over) is forwarded.
    pub fn selects(&self, name: &str) -> bool {
        if name.starts_with(':') || is_never_forwarded(name) {
            return false;
        }
        if self.exact.contains(name) {
            return true;
        }
        if is_sensitive(name) {
            return false;
        }
        self.prefixes.iter().any(|prefix| name.starts_with(prefix))
    }
}

fn is_never_forwarded(name: &str) -> bool {
    NEVER_FORWARDED.contains(&name)
}

fn is_sensitive(name: &str) -> bool {
    SENSITIVE.contains(&name) || name.starts_with(SENSITIVE_PREFIX)
}

/// A `tchar` of RFC 9110: what a header name or method may be made of.
pub fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A header value that cannot split a header block: no CR, LF or NUL.
pub fn is_valid_value(value: &str) -> bool {
    !value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0)
}

/// Checks a subscriber's extra header; returns its lower-cased name.
pub fn validate_extra_header(name: &str, value: &str) -> Result<String, String> {
    if name.is_empty() || !name.bytes().all(is_token_byte) {
        return Err(format!(
            "\"{name}\" is not a header name (letters, digits and -; pseudo-headers are set \
             from `path` and `authority`)"
        ));
    }
    let name = name.to_ascii_lowercase();
    if is_never_forwarded(&name) {
        return Err(format!(
            "\"{name}\" cannot be set: it belongs to one connection or Envoy sets it on each call"
        ));
    }
    if !is_valid_value(value) {
        return Err("the value must not contain CR, LF or NUL".to_string());
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn default_selector() -> HeaderSelector {
        HeaderSelector::new(crate::config::DEFAULT_FORWARD_HEADERS).unwrap()
    }

    #[test]
    fn default_list_selection_table() {
        let selector = default_selector();
        let cases = [
            ("content-type", true),
            ("x-request-id", true),
            ("traceparent", true),
            ("tracestate", true),
            ("ce-type", true),
            ("ce-id", true),
            ("ce-myextension", true),
            ("knative-history", true),
            ("x-b3-traceid", true),
            ("x-b3-sampled", true),
            // never, whatever the list says
            (":authority", false),
            (":path", false),
            ("host", false),
            ("content-length", false),
            ("transfer-encoding", false),
            ("connection", false),
            ("te", false),
            // not listed
            ("authorization", false),
            ("cookie", false),
            ("proxy-authorization", false),
            ("x-envoy-original-path", false),
            ("x-forwarded-for", false),
            ("user-agent", false),
            ("x-b3", false),
        ];
        for (name, want) in cases {
            assert_eq!(selector.selects(name), want, "{name}");
        }
    }

    #[test]
    fn a_prefix_never_picks_up_credentials_or_envoy_headers() {
        let selector = HeaderSelector::new(&["*", "x-*"]).unwrap();
        assert!(selector.selects("user-agent"));
        assert!(selector.selects("x-custom"));
        assert!(!selector.selects("authorization"));
        assert!(!selector.selects("cookie"));
        assert!(!selector.selects("x-envoy-expected-rq-timeout-ms"));
        assert!(!selector.selects("content-length"));
        assert!(selector.sensitive_entries().is_empty());
    }

    #[test]
    fn credentials_travel_when_named_exactly_and_are_reported() {
        let selector = HeaderSelector::new(&["Authorization", "x-envoy-attempt-count"]).unwrap();
        assert!(selector.selects("authorization"));
        assert!(selector.selects("x-envoy-attempt-count"));
        assert!(!selector.selects("cookie"));
        assert_eq!(
            selector.sensitive_entries(),
            vec!["authorization", "x-envoy-attempt-count"]
        );
    }

    #[test]
    fn bad_entries_are_refused_with_their_index() {
        assert_eq!(HeaderSelector::new(&["ok", ""]).unwrap_err().0, 1);
        assert_eq!(HeaderSelector::new(&["a b"]).unwrap_err().0, 0);
        assert_eq!(HeaderSelector::new(&["x-*-y"]).unwrap_err().0, 0);
        assert_eq!(HeaderSelector::new(&["host"]).unwrap_err().0, 0);
        assert_eq!(HeaderSelector::new(&[":path"]).unwrap_err().0, 0);
    }

    #[test]
    fn extra_headers_are_checked() {
        assert_eq!(
            validate_extra_header("X-Tenant", "acme").unwrap(),
            "x-tenant"
        );
        assert!(validate_extra_header("", "v").is_err());
        assert!(validate_extra_header(":path", "/").is_err());
        assert!(validate_extra_header("Host", "x").is_err());
        assert!(validate_extra_header("x-a", "a\nb").is_err());
    }
}
