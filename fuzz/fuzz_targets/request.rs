//! Request admission and routing on arbitrary requests, against a config that is itself
//! drawn from the input (channels with hosts, `forward_headers`, `methods`, `max_body_bytes`).
//!
//! The request is what Envoy hands the filter: header names lower-case (Envoy's header maps
//! are), values arbitrary bytes, and a body of some length. Properties:
//! - `request::admit` never panics, and decides in the documented order: OPTIONS answered 200
//!   (or 400 for a `webhook-request-origin` that is not UTF-8), 405 (method), 404
//!   (no channel for the host), 413 (declared length over `max_body_bytes`), 400 (a forwarded
//!   value that is not UTF-8), else admitted; a body over `max_body_bytes` gets 413 too;
//! - every rejection is a JSON `{"error": ...}` whose header values cannot split a header
//!   block, whatever the request held;
//! - an admitted request goes to the channel its host names (or the wildcard), and nothing
//!   else: no header selects another channel, and the calls built from it (as the filter
//!   builds them) carry exactly the configured `:method`, `:path` and `:authority`, never a
//!   hop-by-hop header, and credentials or `x-envoy-*` only when listed by their exact name;
//! - the filter adds no invalid header value: if the request's values had no CR, LF or NUL,
//!   neither have the calls'.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fanout::answer::Answer;
use fanout::config::{Config, DEFAULT_FORWARD_HEADERS};
use fanout::headers::{is_valid_value, HeaderMap};
use fanout::request::admit;
use fanout::routing::normalize_host;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

/// The filter's own lists: what is never forwarded, and what only when named exactly.
use fanout::headers::{NEVER_FORWARDED as NEVER, SENSITIVE as CREDENTIALS};

#[derive(Debug)]
struct Input {
    /// Per channel, its hosts (None: the default, `["*"]`).
    channels: Vec<Option<Vec<String>>>,
    forward: Option<Vec<String>>,
    methods: Option<Vec<String>>,
    max_body_bytes: Option<u64>,
    headers: Vec<(String, Vec<u8>)>,
    body_len: u64,
}

const HOSTS: &[&str] = &[
    "orders.default",
    "Orders.Default",
    "orders",
    "payments.default.svc.cluster.local",
    "*",
    "[::1]",
    "127.0.0.1",
    "a:b",
    "xn--bcher-kva.example",
    "orders.default.",
];
const HOST_PARTS: &[&str] = &[
    "orders", ".", "default", ":", "8080", "@", "[", "]", "::1", "*", "O", "/", " ", "%2e", "\r\n",
    "\0", "é", "\u{ff}", "x-envoy", "svc", "0",
];
const NAMES: &[&str] = &[
    ":method",
    ":authority",
    ":path",
    ":scheme",
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "te",
    "upgrade",
    "expect",
    "authorization",
    "cookie",
    "proxy-authorization",
    "x-envoy-original-path",
    "x-envoy-upstream-alt-stat-name",
    "x-envoy-internal",
    "x-forwarded-host",
    "x-forwarded-for",
    "x-original-url",
    "x-rewrite-url",
    "x-cluster",
    "ce-id",
    "ce-type",
    "webhook-request-origin",
    "ce-source",
    "knative-history",
    "x-request-id",
    "traceparent",
    "x-b3-traceid",
    "user-agent",
];
const NAME_PARTS: &[&str] = &[
    "x-", "envoy-", "ce-", "a", "z", "0", "-", "_", ":", "*", ".",
];
const VALUE_PARTS: &[&str] = &[
    "POST",
    "GET",
    "post",
    "orders.default",
    ":8080",
    "/",
    "..",
    "%2F",
    "\r\n",
    "\n",
    "\r",
    "\0",
    " ",
    "\t",
    "evil",
    "x-envoy-upstream: evil",
    "host: evil",
    "42",
    "-1",
    "99999999999999999999",
    "1048577",
    "0",
];

fn pick_word(u: &mut Unstructured<'_>, parts: &[&str], max: usize) -> arbitrary::Result<String> {
    let len = u.int_in_range(0..=max)?;
    let mut s = String::new();
    for _ in 0..len {
        s.push_str(u.choose(parts)?);
    }
    Ok(s)
}

fn host(u: &mut Unstructured<'_>) -> arbitrary::Result<String> {
    if u.ratio(3, 4)? {
        Ok((*u.choose(HOSTS)?).to_owned())
    } else {
        pick_word(u, HOST_PARTS, 5)
    }
}

fn name(u: &mut Unstructured<'_>) -> arbitrary::Result<String> {
    if u.ratio(4, 5)? {
        Ok((*u.choose(NAMES)?).to_owned())
    } else {
        pick_word(u, NAME_PARTS, 5)
    }
}

fn value(u: &mut Unstructured<'_>, name: &str) -> arbitrary::Result<Vec<u8>> {
    match u.int_in_range(0..=9)? {
        0 => Ok(Vec::<u8>::arbitrary(u)?),
        1 if name == ":authority" || name == "host" => Ok(host(u)?.into_bytes()),
        2..=4 if name == ":authority" || name == "host" => Ok((*u.choose(HOSTS)?).into()),
        _ => Ok(pick_word(u, VALUE_PARTS, 4)?.into_bytes()),
    }
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let n = u.int_in_range(1..=3)?;
        let mut channels = Vec::new();
        for _ in 0..n {
            channels.push(if u.ratio(1, 4)? {
                None
            } else {
                let k = u.int_in_range(1..=3)?;
                let mut hosts = Vec::new();
                for _ in 0..k {
                    hosts.push(host(u)?);
                }
                Some(hosts)
            });
        }
        let forward = if u.ratio(1, 2)? {
            None
        } else {
            let k = u.int_in_range(0..=4)?;
            let mut list = Vec::new();
            for _ in 0..k {
                let mut entry = name(u)?;
                if u.ratio(1, 3)? {
                    entry.push('*');
                }
                list.push(entry);
            }
            Some(list)
        };
        let methods = if u.ratio(2, 3)? {
            None
        } else {
            Some(vec![(*u
                .choose(&["POST", "PUT", "GET", "post", "PATCH"])?)
            .to_owned()])
        };
        let max_body_bytes = if u.ratio(1, 2)? {
            None
        } else {
            Some(u.int_in_range(0..=2_000_000)?)
        };
        let k = u.int_in_range(0..=12)?;
        let mut headers = Vec::new();
        if u.ratio(7, 8)? {
            let method = (*u.choose(&["POST", "PUT", "GET", "post", "", "OPTIONS"])?)
                .as_bytes()
                .to_vec();
            headers.push((":method".to_owned(), method));
        }
        if u.ratio(7, 8)? {
            headers.push((":authority".to_owned(), value(u, ":authority")?));
        }
        for _ in 0..k {
            let n = name(u)?;
            let v = value(u, &n)?;
            headers.push((n, v));
        }
        // Envoy hands header names lower-case; a request cannot make it otherwise.
        for (n, _) in &mut headers {
            n.make_ascii_lowercase();
        }
        Ok(Input {
            channels,
            forward,
            methods,
            max_body_bytes,
            headers,
            body_len: u.int_in_range(0..=2_100_000)?,
        })
    }
}

fuzz_target!(|input: Input| {
    let channels: Vec<Value> = input
        .channels
        .iter()
        .enumerate()
        .map(|(i, hosts)| {
            let mut c = json!({ "name": format!("ch{i}"), "subscribers": [
                { "cluster": format!("c{i}"), "authority": format!("sub{i}.internal"),
                  "path": format!("/p{i}"), "headers": { "x-sub": format!("{i}") } }
            ] });
            if let Some(hosts) = hosts {
                c["hosts"] = json!(hosts);
            }
            c
        })
        .collect();
    let mut doc = json!({ "channels": channels });
    if let Some(f) = &input.forward {
        doc["forward_headers"] = json!(f);
    }
    if let Some(m) = &input.methods {
        doc["methods"] = json!(m);
    }
    if let Some(m) = input.max_body_bytes {
        doc["max_body_bytes"] = json!(m);
    }
    let Ok(config) = Config::from_json(doc.to_string().as_bytes()) else {
        return;
    };
    let hosts: Vec<Vec<String>> = input
        .channels
        .iter()
        .map(|h| h.clone().unwrap_or_else(|| vec!["*".to_owned()]))
        .collect();
    let listed: Vec<String> = input
        .forward
        .clone()
        .unwrap_or_else(|| {
            DEFAULT_FORWARD_HEADERS
                .iter()
                .map(|s| (*s).to_owned())
                .collect()
        })
        .iter()
        .map(|s| s.to_ascii_lowercase())
        .collect();

    let headers = HeaderMap::from_pairs(&input.headers);
    let result = admit(&config, &headers);

    // The expected decision, from the contract.
    let find = |name: &str| {
        input
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    };
    let method = find(":method").unwrap_or_default();
    let authority = find(":authority")
        .or_else(|| find("host"))
        .unwrap_or_default();
    // Routing reads it: it must be UTF-8 (a 400 naming it otherwise).
    let authority_text = std::str::from_utf8(authority).is_ok();
    let authority = String::from_utf8_lossy(authority).into_owned();
    let route = config.router.route(&authority);
    let declared = find("content-length")
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|s| s.trim().parse::<u64>().ok());
    let expected = if method == b"OPTIONS" {
        let origin = find("webhook-request-origin").map(std::str::from_utf8);
        if origin.is_some_and(|o| o.map_or(true, |o| !is_valid_value(o))) {
            400
        } else {
            200
        }
    } else if !config.methods.iter().any(|m| m.as_bytes() == method) {
        405
    } else if !authority_text {
        400
    } else if route.is_none() {
        404
    } else if declared.is_some_and(|d| d > config.max_body_bytes) {
        413
    } else if route.is_some_and(|c| !config.channels[c].subscribers.is_empty())
        && input
            .headers
            .iter()
            .any(|(n, v)| config.forward.selects(n) && !is_valid_value(v))
    {
        // Forwarded values go on byte for byte; only one that would split the header block
        // of a call is refused.
        400
    } else {
        0
    };

    // Routing: a channel only through one of its hosts, or its wildcard; case never matters.
    let norm = normalize_host(&authority).into_owned();
    match route {
        Some(c) => {
            assert!(c < config.channels.len());
            let exact = hosts[c]
                .iter()
                .any(|h| h != "*" && normalize_host(h).eq_ignore_ascii_case(&norm));
            assert!(
                exact || hosts[c].iter().any(|h| h == "*"),
                "{authority:?} -> ch{c}"
            );
            // When the host names a channel exactly, that channel wins over a wildcard.
            for (other, hs) in hosts.iter().enumerate() {
                if hs
                    .iter()
                    .any(|h| h != "*" && normalize_host(h).eq_ignore_ascii_case(&norm))
                {
                    assert_eq!(other, c, "{authority:?} names ch{other}, routed to ch{c}");
                }
            }
        }
        None => {
            assert!(!hosts.iter().flatten().any(|h| h == "*"));
        }
    }
    assert_eq!(route, config.router.route(&authority.to_ascii_uppercase()));
    assert_eq!(route, config.router.route(&authority.to_ascii_lowercase()));

    match result {
        Err(answer) if answer.status == 200 => {
            assert_eq!(expected, 200, "{input:#?}\n{answer:?}");
            assert!(answer.body.is_empty());
            for (name, value) in answer.header_pairs() {
                assert!(is_valid_value(value), "{name}: {value:?}");
            }
            assert!(answer
                .headers
                .iter()
                .any(|(n, v)| *n == "allow" && *v == config.allow));
        }
        Err(answer) => {
            assert_eq!(answer.status, expected, "{input:#?}\n{answer:?}");
            check_rejection(&answer);
            if answer.status == 405 {
                assert!(answer
                    .headers
                    .iter()
                    .any(|(n, v)| *n == "allow" && *v == config.allow));
            }
        }
        Ok(admitted) => {
            assert_eq!(expected, 0, "admitted, expected {expected}: {input:#?}");
            assert_eq!(Some(admitted.channel), route);
            // A channel nobody subscribes to forwards nothing.
            let nobody = config.channels[admitted.channel].subscribers.is_empty();
            let want: Vec<(String, Vec<u8>)> = input
                .headers
                .iter()
                .filter(|(n, _)| !nobody && config.forward.selects(n))
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
            let forwarded = admitted.forwarded.to_pairs();
            assert_eq!(forwarded, want);
            for (name, _) in &forwarded {
                assert!(!name.starts_with(':'), "{name} forwarded");
                assert!(!NEVER.contains(&name.as_str()), "{name} forwarded");
                if CREDENTIALS.contains(&name.as_str()) || name.starts_with("x-envoy-") {
                    assert!(
                        listed.contains(name),
                        "{name} forwarded, not listed: {listed:?}"
                    );
                }
            }
            // The calls, as the filter builds them.
            let channel = &config.channels[admitted.channel];
            for sub in &channel.subscribers {
                let call: Vec<(&str, &[u8])> = sub
                    .call_headers
                    .iter()
                    .map(|(n, v)| (n.as_str(), v.as_bytes()))
                    .chain(forwarded.iter().map(|(n, v)| (n.as_str(), v.as_slice())))
                    .collect();
                let one = |name: &str| {
                    let v: Vec<&[u8]> = call
                        .iter()
                        .filter(|(n, _)| *n == name)
                        .map(|(_, v)| *v)
                        .collect();
                    assert_eq!(v.len(), 1, "{name} in {call:?}");
                    v[0]
                };
                assert_eq!(one(":method"), b"POST");
                assert_eq!(one(":path"), sub.path.as_bytes());
                assert_eq!(one(":authority"), sub.authority.as_bytes());
                assert!(sub.cluster.starts_with('c'));
                for (n, _) in &call {
                    assert!(!NEVER.contains(n), "{n} in a call");
                }
                let request_valid = input
                    .headers
                    .iter()
                    .all(|(_, v)| !v.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)));
                if request_valid {
                    for (n, v) in &call {
                        assert!(is_valid_value(v), "{n}: {v:?}");
                    }
                }
            }
            // The body decides last: over max_body_bytes it is a 413 as well.
            if input.body_len > config.max_body_bytes {
                let answer = Answer::too_large(config.max_body_bytes);
                assert_eq!(answer.status, 413);
                check_rejection(&answer);
            }
        }
    }
});

fn check_rejection(answer: &Answer) {
    let doc: Value = serde_json::from_slice(&answer.body).expect("a rejection is JSON");
    assert!(doc["error"].as_str().is_some_and(|e| !e.is_empty()));
    for (name, value) in answer.header_pairs() {
        assert!(is_valid_value(value), "{name}: {value:?}");
    }
}
