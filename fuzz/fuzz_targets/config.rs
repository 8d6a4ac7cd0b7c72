//! The configuration parser and validator on arbitrary input.
//!
//! Two ways to read the input: as the raw plugin configuration bytes (most inputs; the seed
//! corpus and `config.dict` steer it towards JSON), or, when the first byte is 0, as a
//! structured description turned into a JSON document (so that deep, nearly valid configs are
//! reached quickly).
//!
//! Properties:
//! - `Config::from_json` never panics;
//! - a refused config says why (a non-empty message), and the same way every time;
//! - an accepted config is the whole input (nothing after the JSON document);
//! - an accepted config keeps every promise the filter relies on at request time, for every
//!   call target (subscribers, dead-letter and reply targets): no value that could split a
//!   header block, a path that starts with `/`, no timeout of 0, the call pseudo-headers
//!   first and only once, no hop-by-hop header; unique channel names; every configured host
//!   routes to its channel and nothing else does except through `*`; credentials and
//!   `x-envoy-*` are forwarded only when listed by exact name;
//! - it round-trips: parsing the same bytes again gives the same config, and its normalized
//!   form (every default written out) is accepted and gives the same config again.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fanout::config::{Config, DEFAULT_FORWARD_HEADERS};
use fanout::headers::{is_token_byte, is_valid_value};
use fanout::metrics::stat_segment;
use fanout::routing::normalize_host;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

fuzz_target!(|data: &[u8]| {
    if let Some((&0, rest)) = data.split_first() {
        let mut u = Unstructured::new(rest);
        if let Ok(doc) = Doc::arbitrary(&mut u) {
            check(doc.to_json().to_string().as_bytes());
        }
    } else {
        check(data);
    }
});

fn check(bytes: &[u8]) {
    match Config::from_json(bytes) {
        Err(error) => {
            assert!(!error.message.is_empty(), "an error without a message");
            assert!(!error.to_string().is_empty());
            // Deterministic: the same bytes are refused the same way.
            assert_eq!(Config::from_json(bytes).err(), Some(error));
        }
        Ok(config) => {
            // Accepted means the whole input is one JSON document: nothing after it.
            let whole = serde_json::from_slice::<Value>(bytes);
            if whole.is_err() && !allow_known("trailing") {
                panic!(
                    "accepted a config with bytes after the JSON document: {:?}",
                    String::from_utf8_lossy(bytes)
                );
            }
            // The first JSON value of the input is the document that was read.
            let doc: Value = serde_json::Deserializer::from_slice(bytes)
                .into_iter::<Value>()
                .next()
                .and_then(Result::ok)
                .expect("an accepted config starts with a JSON object");
            let input = Input::of(&doc);
            check_invariants(&config, &input);
            let expected = meaning(&config);
            let again = Config::from_json(bytes).expect("accepted once, refused the second time");
            assert_eq!(
                meaning(&again),
                expected,
                "the same bytes gave another config"
            );
            let normalized = normalize(&doc).to_string();
            let reparsed = Config::from_json(normalized.as_bytes())
                .unwrap_or_else(|e| panic!("normalized form refused: {e}\n{normalized}"));
            assert_eq!(
                meaning(&reparsed),
                expected,
                "the normalized form means something else:\n{normalized}"
            );
            assert_eq!(probe(&reparsed, &input), probe(&config, &input));
        }
    }
}

/// Findings already reported (see fuzz/README.md) can be let through with
/// `FANOUT_FUZZ_ALLOW_KNOWN=trailing,...` so that a long run goes on looking for new ones.
/// By default every property is enforced.
fn allow_known(name: &str) -> bool {
    std::env::var("FANOUT_FUZZ_ALLOW_KNOWN")
        .is_ok_and(|v| v.split(',').any(|k| k.trim() == name || k.trim() == "all"))
}

/// A config's meaning, independent of hash-map order: the lines of its `Debug` form, sorted.
fn meaning(config: &Config) -> Vec<String> {
    let mut lines: Vec<String> = format!("{config:#?}").lines().map(str::to_owned).collect();
    lines.sort_unstable();
    lines
}

/// The document with every default written out: the `channels` shape, channel names and
/// hosts, subscribers' authorities, paths and timeouts, and the top-level options. Anything
/// else (options this target does not know) is kept as it was.
fn normalize(doc: &Value) -> Value {
    let mut doc = doc.clone();
    let Some(obj) = doc.as_object_mut() else {
        return doc;
    };
    let present = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    let shorthand = obj.remove("subscribers").filter(|v| !v.is_null());
    if !present(obj.get("channels")) {
        obj.remove("channels");
    }
    if let Some(subscribers) = shorthand {
        obj.insert(
            "channels".into(),
            json!([{ "name": "default", "hosts": ["*"], "subscribers": subscribers }]),
        );
    }
    let defaults = [
        (
            "max_body_bytes",
            json!(fanout::config::DEFAULT_MAX_BODY_BYTES),
        ),
        ("methods", json!(["POST"])),
        ("forward_headers", json!(DEFAULT_FORWARD_HEADERS)),
        ("metrics", json!(true)),
        ("body_wait", json!("pause")),
        ("require_cloudevents", json!(false)),
    ];
    for (name, value) in defaults {
        if !present(obj.get(name)) {
            obj.insert(name.into(), value);
        }
    }
    let timeout = obj
        .get("timeout_ms")
        .filter(|v| !v.is_null())
        .cloned()
        .unwrap_or(json!(fanout::config::DEFAULT_TIMEOUT_MS));
    if let Some(Value::Array(channels)) = obj.get_mut("channels") {
        for (i, channel) in channels.iter_mut().enumerate() {
            let Some(channel) = channel.as_object_mut() else {
                continue;
            };
            if !present(channel.get("name")) {
                channel.insert("name".into(), json!(format!("channels[{i}]")));
            }
            if !present(channel.get("hosts")) {
                channel.insert("hosts".into(), json!(["*"]));
            }
            if let Some(Value::Array(subs)) = channel.get_mut("subscribers") {
                for sub in subs.iter_mut().filter_map(Value::as_object_mut) {
                    let cluster = sub.get("cluster").cloned().unwrap_or(Value::Null);
                    for (name, value) in [
                        ("authority", cluster),
                        ("path", json!("/")),
                        ("timeout_ms", timeout.clone()),
                    ] {
                        if !present(sub.get(name)) {
                            sub.insert(name.into(), value);
                        }
                    }
                }
            }
        }
    }
    doc
}

/// What the input said about hosts and forwarded headers (the config does not show them),
/// and names to probe the router and the header selector with.
struct Input {
    /// Each channel's `hosts` (`["*"]` when not given, and for the shorthand).
    hosts: Vec<Vec<String>>,
    /// `forward_headers`, lower-cased (the default list when not given).
    listed: Vec<String>,
    probe_hosts: Vec<String>,
    probe_names: Vec<String>,
}

/// The filter's own lists: what is never forwarded, and what only when named exactly.
use fanout::headers::{NEVER_FORWARDED as NEVER, SENSITIVE as CREDENTIALS};

fn strings(v: Option<&Value>) -> Option<Vec<String>> {
    v.and_then(Value::as_array).map(|a| {
        a.iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    })
}

impl Input {
    fn of(doc: &Value) -> Input {
        let hosts: Vec<Vec<String>> = match doc.get("channels").and_then(Value::as_array) {
            Some(channels) => channels
                .iter()
                .map(|c| strings(c.get("hosts")).unwrap_or_else(|| vec!["*".to_owned()]))
                .collect(),
            None => vec![vec!["*".to_owned()]],
        };
        let listed: Vec<String> = strings(doc.get("forward_headers"))
            .unwrap_or_else(|| {
                DEFAULT_FORWARD_HEADERS
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect()
            })
            .iter()
            .map(|s| s.to_ascii_lowercase())
            .collect();
        let mut probe_hosts: Vec<String> = Vec::new();
        for host in hosts.iter().flatten() {
            probe_hosts.push(host.clone());
            probe_hosts.push(host.to_ascii_uppercase());
            probe_hosts.push(format!("{host}:8080"));
            probe_hosts.push(format!("{host}."));
            probe_hosts.push(format!("x.{host}"));
            probe_hosts.push(format!("{host}@evil"));
        }
        probe_hosts.extend(["", "*", "unknown.example", "[::1]:80"].map(str::to_owned));
        let mut probe_names: Vec<String> = NEVER
            .iter()
            .chain(CREDENTIALS)
            .chain(&[
                ":authority",
                ":path",
                ":method",
                ":scheme",
                "x-envoy-original-path",
                "x-envoy-upstream-rq-timeout-ms",
                "content-type",
                "ce-id",
                "x-b3-traceid",
                "user-agent",
            ])
            .map(|s| (*s).to_owned())
            .collect();
        for entry in &listed {
            match entry.strip_suffix('*') {
                Some(prefix) => {
                    probe_names.push(format!("{prefix}x"));
                    probe_names.push(format!("{prefix}authorization"));
                    probe_names.push(prefix.to_owned());
                }
                None => probe_names.push(entry.clone()),
            }
        }
        Input {
            hosts,
            listed,
            probe_hosts,
            probe_names,
        }
    }
}

fn probe(config: &Config, input: &Input) -> (Vec<Option<usize>>, Vec<bool>) {
    (
        input
            .probe_hosts
            .iter()
            .map(|h| config.router.route(h))
            .collect(),
        input
            .probe_names
            .iter()
            .map(|n| config.forward.selects(n))
            .collect(),
    )
}

/// Checks one call target as the filter will use it: nothing in it can split a header block
/// or make Envoy wait forever.
fn check_target(
    cluster: &str,
    authority: &str,
    path: &str,
    timeout: std::time::Duration,
    call_headers: &[(String, String)],
) {
    assert!(!cluster.trim().is_empty());
    assert!(!cluster.chars().any(char::is_control), "{cluster:?}");
    assert!(
        !authority.is_empty() && is_valid_value(authority),
        "{authority:?}"
    );
    assert!(!authority.contains(' '));
    assert!(path.starts_with('/'));
    assert!(!path.bytes().any(|b| b <= b' ' || b == 0x7f), "{path:?}");
    assert!(
        timeout.as_millis() >= 1,
        "a timeout of 0 is no timeout in Envoy"
    );
    assert_eq!(call_headers[0], (":method".to_owned(), "POST".to_owned()));
    assert_eq!(call_headers[1], (":path".to_owned(), path.to_owned()));
    assert_eq!(
        call_headers[2],
        (":authority".to_owned(), authority.to_owned())
    );
    for (name, value) in &call_headers[3..] {
        assert!(
            !name.is_empty() && name.bytes().all(is_token_byte),
            "{name:?}"
        );
        assert_eq!(name, &name.to_ascii_lowercase());
        assert!(!NEVER.contains(&name.as_str()), "{name} set by config");
        assert!(is_valid_value(value), "{name}: {value:?}");
    }
    let segment = stat_segment(cluster);
    assert!(!segment.is_empty());
    assert!(segment
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'));
}

/// The promises an accepted config makes to the request path.
fn check_invariants(config: &Config, input: &Input) {
    assert!(!config.methods.is_empty());
    for method in &config.methods {
        assert!(
            !method.is_empty() && method.bytes().all(is_token_byte),
            "{method:?}"
        );
        assert!(
            !method.bytes().any(|b| b.is_ascii_lowercase()),
            "{method:?}"
        );
    }
    // OPTIONS is the filter's own answer, never a method to fan out.
    assert!(!config.methods.iter().any(|m| m == "OPTIONS"));
    assert_eq!(
        config.allow,
        format!("{}, OPTIONS", config.methods.join(", "))
    );
    assert_eq!(config.channels.len(), input.hosts.len());
    let mut names = std::collections::HashSet::new();
    for (c, channel) in config.channels.iter().enumerate() {
        assert!(!channel.name.trim().is_empty());
        assert!(
            names.insert(channel.name.clone()),
            "two channels named {:?}",
            channel.name
        );
        for s in &channel.subscribers {
            check_target(
                &s.cluster,
                &s.authority,
                &s.path,
                s.timeout,
                &s.call_headers,
            );
            for t in s.dead_letter.iter().chain(&s.reply) {
                check_target(
                    &t.cluster,
                    &t.authority,
                    &t.path,
                    t.timeout,
                    &t.call_headers,
                );
            }
        }
        // Every configured host reaches its own channel, whatever its case or port.
        for host in &input.hosts[c] {
            if host == "*" {
                continue;
            }
            for probe in [host.clone(), host.to_ascii_uppercase()] {
                assert_eq!(config.router.route(&probe), Some(c), "{probe:?}");
            }
            // With a port too; except for a host that opens an IPv6 bracket and never closes
            // it ("[[[zaa"), which the router accepts but cannot tell from its port (a request
            // cannot carry such a host either: it is no host name).
            if !host.starts_with('[') || host.contains(']') {
                let probe = format!("{host}:1");
                assert_eq!(config.router.route(&probe), Some(c), "{probe:?}");
            }
        }
    }
    let (routes, selects) = probe(config, input);
    for (host, route) in input.probe_hosts.iter().zip(&routes) {
        if let Some(c) = route {
            assert!(*c < config.channels.len());
            // An exact match is a configured host; anything else is the wildcard's.
            let norm = normalize_host(host);
            let exact = input.hosts[*c]
                .iter()
                .any(|h| h != "*" && normalize_host(h).eq_ignore_ascii_case(&norm));
            let wildcard = input.hosts[*c].iter().any(|h| h == "*");
            assert!(exact || wildcard, "{host:?} routed to channels[{c}]");
        }
    }
    for (name, selected) in input.probe_names.iter().zip(&selects) {
        // Never: pseudo-headers and hop-by-hop, whatever the list says.
        if name.starts_with(':') || NEVER.contains(&name.as_str()) {
            assert!(!selected, "{name} is forwarded");
        }
        // Credentials and x-envoy-*: only when listed by their exact name.
        if CREDENTIALS.contains(&name.as_str()) || name.starts_with("x-envoy-") {
            assert_eq!(
                *selected,
                input.listed.contains(name),
                "{name} with {:?}",
                input.listed
            );
        }
    }
    for name in config.forward.sensitive_entries() {
        assert!(input.listed.iter().any(|l| l == name));
    }
}

// ----------------------------------------------------------------------------------------
// The structured mode: a document shaped like a config, with values drawn from small
// alphabets that contain the characters the validator cares about.

#[derive(Arbitrary, Debug)]
struct Doc {
    timeout_ms: Option<u32>,
    max_body_bytes: Option<u64>,
    methods: Option<Vec<Word>>,
    forward_headers: Option<Vec<Word>>,
    channels: Option<Vec<ChannelDoc>>,
    subscribers: Option<Vec<SubscriberDoc>>,
    metrics: Option<bool>,
    body_wait: Option<u8>,
    delivery: Option<DeliveryDoc>,
    reply: Option<TargetDoc>,
    mode: Option<u8>,
    max_in_flight: Option<u32>,
    unknown_field: bool,
}

#[derive(Arbitrary, Debug)]
struct DeliveryDoc {
    retry: Option<u8>,
    backoff_policy: Option<bool>,
    backoff_delay_ms: Option<u32>,
    backoff_max_ms: Option<u32>,
    dead_letter: Option<TargetDoc>,
}

#[derive(Arbitrary, Debug)]
struct TargetDoc {
    cluster: Option<Word>,
    path: Option<Word>,
    timeout_ms: Option<u32>,
    headers: Vec<(Word, Word)>,
}

#[derive(Arbitrary, Debug)]
struct ChannelDoc {
    name: Option<Word>,
    hosts: Option<Vec<Word>>,
    subscribers: Option<Vec<SubscriberDoc>>,
}

#[derive(Arbitrary, Debug)]
struct SubscriberDoc {
    cluster: Option<Word>,
    authority: Option<Word>,
    path: Option<Word>,
    timeout_ms: Option<u32>,
    headers: Vec<(Word, Word)>,
    delivery: Option<DeliveryDoc>,
    reply: Option<TargetDoc>,
}

/// A short string over an alphabet of interesting characters.
#[derive(Debug)]
struct Word(String);

const ALPHABET: &[&str] = &[
    "a",
    "B",
    "z",
    "0",
    "9",
    "-",
    "_",
    ".",
    ":",
    "/",
    "*",
    " ",
    "\t",
    "\r",
    "\n",
    "\0",
    "\u{7f}",
    "@",
    "[",
    "]",
    "%",
    "?",
    "#",
    "é",
    "\u{2028}",
    "POST",
    "host",
    "x-envoy-",
    "ce-",
    "authorization",
    "cookie",
    "content-length",
    "te",
    ":path",
    ":authority",
    "orders",
    "8080",
];

impl<'a> Arbitrary<'a> for Word {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let len = u.int_in_range(0..=6)?;
        let mut s = String::new();
        for _ in 0..len {
            s.push_str(u.choose(ALPHABET)?);
        }
        Ok(Word(s))
    }
}

impl Doc {
    fn to_json(&self) -> Value {
        let mut doc = Map::new();
        if let Some(t) = self.timeout_ms {
            doc.insert("timeout_ms".into(), json!(t));
        }
        if let Some(m) = self.max_body_bytes {
            doc.insert("max_body_bytes".into(), json!(m));
        }
        if let Some(m) = &self.methods {
            doc.insert("methods".into(), words(m));
        }
        if let Some(f) = &self.forward_headers {
            doc.insert("forward_headers".into(), words(f));
        }
        if let Some(channels) = &self.channels {
            let channels: Vec<Value> = channels
                .iter()
                .map(|c| {
                    let mut o = Map::new();
                    if let Some(n) = &c.name {
                        o.insert("name".into(), json!(n.0));
                    }
                    if let Some(h) = &c.hosts {
                        o.insert("hosts".into(), words(h));
                    }
                    if let Some(s) = &c.subscribers {
                        o.insert("subscribers".into(), subscribers(s));
                    }
                    Value::Object(o)
                })
                .collect();
            doc.insert("channels".into(), Value::Array(channels));
        }
        if let Some(s) = &self.subscribers {
            doc.insert("subscribers".into(), subscribers(s));
        }
        if let Some(m) = self.metrics {
            doc.insert("metrics".into(), json!(m));
        }
        if let Some(b) = self.body_wait {
            let v = match b % 3 {
                0 => "pause",
                1 => "continue",
                _ => "Pause",
            };
            doc.insert("body_wait".into(), json!(v));
        }
        if let Some(d) = &self.delivery {
            doc.insert("delivery".into(), d.to_json());
        }
        if let Some(r) = &self.reply {
            doc.insert("reply".into(), r.to_json());
        }
        if let Some(m) = self.mode {
            doc.insert(
                "mode".into(),
                json!(["sync", "async", "Sync"][usize::from(m % 3)]),
            );
        }
        if let Some(m) = self.max_in_flight {
            doc.insert("max_in_flight".into(), json!(m));
        }
        if self.unknown_field {
            doc.insert("timeout".into(), json!(1));
        }
        Value::Object(doc)
    }
}

fn words(w: &[Word]) -> Value {
    Value::Array(w.iter().map(|w| json!(w.0)).collect())
}

fn subscribers(s: &[SubscriberDoc]) -> Value {
    Value::Array(
        s.iter()
            .map(|s| {
                let mut o = Map::new();
                if let Some(c) = &s.cluster {
                    o.insert("cluster".into(), json!(c.0));
                }
                if let Some(a) = &s.authority {
                    o.insert("authority".into(), json!(a.0));
                }
                if let Some(p) = &s.path {
                    o.insert("path".into(), json!(p.0));
                }
                if let Some(t) = s.timeout_ms {
                    o.insert("timeout_ms".into(), json!(t));
                }
                if !s.headers.is_empty() {
                    o.insert("headers".into(), headers(&s.headers));
                }
                if let Some(d) = &s.delivery {
                    o.insert("delivery".into(), d.to_json());
                }
                if let Some(r) = &s.reply {
                    o.insert("reply".into(), r.to_json());
                }
                Value::Object(o)
            })
            .collect(),
    )
}

fn headers(h: &[(Word, Word)]) -> Value {
    Value::Object(h.iter().map(|(k, v)| (k.0.clone(), json!(v.0))).collect())
}

impl DeliveryDoc {
    fn to_json(&self) -> Value {
        let mut o = Map::new();
        if let Some(r) = self.retry {
            o.insert("retry".into(), json!(r));
        }
        if let Some(p) = self.backoff_policy {
            o.insert(
                "backoff_policy".into(),
                json!(if p { "linear" } else { "exponential" }),
            );
        }
        if let Some(d) = self.backoff_delay_ms {
            o.insert("backoff_delay_ms".into(), json!(d));
        }
        if let Some(m) = self.backoff_max_ms {
            o.insert("backoff_max_ms".into(), json!(m));
        }
        if let Some(t) = &self.dead_letter {
            o.insert("dead_letter".into(), t.to_json());
        }
        Value::Object(o)
    }
}

impl TargetDoc {
    fn to_json(&self) -> Value {
        let mut o = Map::new();
        if let Some(c) = &self.cluster {
            o.insert("cluster".into(), json!(c.0));
        }
        if let Some(p) = &self.path {
            o.insert("path".into(), json!(p.0));
        }
        if let Some(t) = self.timeout_ms {
            o.insert("timeout_ms".into(), json!(t));
        }
        if !self.headers.is_empty() {
            o.insert("headers".into(), headers(&self.headers));
        }
        Value::Object(o)
    }
}
