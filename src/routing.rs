//! Channel selection: which channel a request belongs to, by its `:authority`.
//!
//! A request's authority is lower-cased and its port stripped, then looked up among the
//! channels' hosts; `"*"` matches any host that no channel names exactly. The table is built
//! once at configure time; a lookup costs one hash of the host and does not depend on the
//! number of channels.

use hashbrown::HashMap;
use std::borrow::Cow;

#[derive(Debug, Default)]
pub struct Router {
    exact: HashMap<String, usize>,
    any: Option<usize>,
}

impl Router {
    /// Claims `host` for the channel at `channel`. Errors are messages for the field.
    pub fn add(&mut self, host: &str, channel: usize) -> Result<(), String> {
        if host.trim().is_empty() {
            return Err("must not be empty (\"*\" matches every host)".to_string());
        }
        if host == "*" {
            return match self.any {
                Some(other) => Err(format!("\"*\" is already claimed by channels[{other}]")),
                None => {
                    self.any = Some(channel);
                    Ok(())
                }
            };
        }
        if host
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b == b'/')
        {
            return Err(format!(
                "\"{host}\" is not a host name (no spaces, slashes or control characters)"
            ));
        }
        if host.starts_with('[') && !is_ipv6_literal(host) {
            return Err(format!(
                "\"{host}\" is not a host name: an IPv6 address is written [hex:digits], with \
                 no port"
            ));
        }
        let normalized = normalize_host(host);
        if normalized.len() != host.trim_end_matches('.').len() {
            return Err(format!(
                "must not contain a port: requests are matched on the host alone (got \"{host}\")"
            ));
        }
        let normalized = normalized.into_owned();
        if let Some(other) = self.exact.get(&normalized) {
            return Err(format!(
                "\"{normalized}\" is already claimed by channels[{other}]"
            ));
        }
        self.exact.insert(normalized, channel);
        Ok(())
    }

    /// The channel for a request's `:authority` (or `host`) header value.
    pub fn route(&self, authority: &str) -> Option<usize> {
        if !self.exact.is_empty() {
            if let Some(&channel) = self.exact.get(normalize_host(authority).as_ref()) {
                return Some(channel);
            }
        }
        self.any
    }
}

/// `[::1]`, `[2001:db8::1]`: brackets around hex digits, colons and dots (an embedded IPv4).
fn is_ipv6_literal(host: &str) -> bool {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .is_some_and(|inner| {
            !inner.is_empty()
                && inner
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        })
}

/// `Orders.Default:8080` -> `orders.default`; `[::1]:80` -> `[::1]`; a trailing dot (a fully
/// qualified name) is dropped. Allocates only when the host has upper-case letters.
pub fn normalize_host(authority: &str) -> Cow<'_, str> {
    let host = strip_port(authority);
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        // An IPv6 literal: the port, if any, follows the closing bracket.
        return match authority.find(']') {
            Some(end) => &authority[..=end],
            None => authority,
        };
    }
    match authority.rfind(':') {
        Some(colon) if authority[colon + 1..].bytes().all(|b| b.is_ascii_digit()) => {
            &authority[..colon]
        }
        _ => authority,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalization_table() {
        let cases = [
            ("orders.default", "orders.default"),
            ("Orders.Default", "orders.default"),
            ("orders.default:8080", "orders.default"),
            ("ORDERS.DEFAULT:80", "orders.default"),
            ("orders.default.", "orders.default"),
            ("orders.default.:443", "orders.default"),
            ("[::1]:8080", "[::1]"),
            ("[::1]", "[::1]"),
            ("127.0.0.1:10000", "127.0.0.1"),
            ("orders", "orders"),
            ("orders:", "orders"),
            ("", ""),
            // Not a port: left alone rather than guessed at.
            ("a:b", "a:b"),
        ];
        for (input, want) in cases {
            assert_eq!(normalize_host(input), want, "normalize_host({input:?})");
        }
    }

    #[test]
    fn ipv6_literals_are_hosts() {
        let mut router = Router::default();
        router.add("[::1]", 0).unwrap();
        router.add("[2001:DB8::1]", 1).unwrap();
        assert_eq!(router.route("[::1]:10000"), Some(0));
        assert_eq!(router.route("[2001:db8::1]"), Some(1));
    }

    #[test]
    fn exact_hosts_win_over_the_wildcard() {
        let mut router = Router::default();
        router.add("orders.default", 0).unwrap();
        router.add("*", 1).unwrap();
        router.add("Payments.Default", 2).unwrap();
        assert_eq!(router.route("orders.default:8080"), Some(0));
        assert_eq!(router.route("payments.default"), Some(2));
        assert_eq!(router.route("PAYMENTS.default:1"), Some(2));
        assert_eq!(router.route("unknown"), Some(1));
        assert_eq!(router.route(""), Some(1));
    }

    #[test]
    fn without_a_wildcard_an_unknown_host_has_no_channel() {
        let mut router = Router::default();
        router.add("orders.default", 0).unwrap();
        assert_eq!(router.route("orders.default.svc"), None);
        assert_eq!(router.route("orders"), None);
    }

    #[test]
    fn a_host_can_be_claimed_once() {
        let mut router = Router::default();
        router.add("a.b", 0).unwrap();
        assert!(router.add("A.B", 1).unwrap_err().contains("channels[0]"));
        router.add("*", 0).unwrap();
        assert!(router.add("*", 1).unwrap_err().contains("channels[0]"));
    }

    #[test]
    fn bad_hosts_are_refused() {
        let mut router = Router::default();
        for host in [
            "",
            " ",
            "a b",
            "a/b",
            "orders:8080",
            "a\r\nb",
            "[[[zaa",
            "[::1]:80",
            "[zz]",
        ] {
            assert!(router.add(host, 0).is_err(), "{host:?} was accepted");
        }
    }
}
