//! Which request headers travel to subscribers, and which never do.
//!
//! `forward_headers` lists names (`x-request-id`) and prefixes (`ce-*`). Some headers are
//! never forwarded whatever the list says: pseudo-headers, hop-by-hop headers, the original
//! `host` and `content-length` (Envoy sets it from the body it sends). Credentials
//! (`authorization`, `cookie`, `proxy-authorization`) and Envoy's own `x-envoy-*` headers
//! travel only when the list names them exactly: a prefix or `*` never picks them up.

use hashbrown::HashSet;

/// A header map as the proxy-wasm ABI serializes it (`proxy_get_header_map_pairs`), read in
/// place: one buffer, no allocation per header. The layout: the number of pairs (u32,
/// little-endian), then each pair's name length and value length (u32 each), then each pair's
/// name and value, every one followed by a NUL. Names and values are bytes (Envoy's names
/// are lower-case tokens); a map whose sizes do not fit its buffer is refused whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    bytes: Vec<u8>,
}

/// Where one pair of a [`HeaderMap`] lies in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairAt {
    name: (u32, u32),
    value: (u32, u32),
}

impl HeaderMap {
    /// The map Envoy handed over; `None` if it is not a well-formed serialization.
    pub fn from_serialized(bytes: Vec<u8>) -> Option<Self> {
        let map = HeaderMap { bytes };
        let declared = map.declared_pairs()?;
        let mut spans = map.spans();
        let walked = spans.by_ref().count();
        (walked == declared && !spans.broken).then_some(map)
    }

    /// The map of `pairs`, through their serialization: what the fake host and the tests hand
    /// to the core, read by the same code as Envoy's.
    pub fn from_pairs<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> Self {
        HeaderMap::from_serialized(serialize(pairs)).unwrap_or_default()
    }

    fn declared_pairs(&self) -> Option<usize> {
        if self.bytes.is_empty() {
            return Some(0);
        }
        Some(read_u32(&self.bytes, 0)? as usize)
    }

    /// Where each pair lies, in the order Envoy gave them.
    pub fn spans(&self) -> Spans<'_> {
        let pairs = self.declared_pairs().unwrap_or(0);
        Spans {
            map: self,
            next: 0,
            pairs,
            data: pairs.saturating_mul(8).saturating_add(4),
            broken: false,
        }
    }

    /// The number of pairs.
    pub fn len(&self) -> usize {
        self.declared_pairs().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The size of the serialization: a bound on the text of all names and values.
    pub fn text_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Every (name, value), in the order Envoy gave them.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.spans().filter_map(|span| self.pair(span))
    }

    /// The value of the first header named `name` (lower-case).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(n, _)| *n == name.as_bytes())
            .map(|(_, v)| v)
    }

    /// The pair at `span` (one of [`HeaderMap::spans`]).
    pub fn pair(&self, span: PairAt) -> Option<(&[u8], &[u8])> {
        Some((self.slice(span.name)?, self.slice(span.value)?))
    }

    /// The pair at `span` as text: `None` if the name or the value is not UTF-8.
    #[cfg(test)]
    pub fn text_pair(&self, span: PairAt) -> Option<(&str, &str)> {
        let (name, value) = self.pair(span)?;
        Some((
            std::str::from_utf8(name).ok()?,
            std::str::from_utf8(value).ok()?,
        ))
    }

    fn slice(&self, (start, len): (u32, u32)) -> Option<&[u8]> {
        let start = start as usize;
        self.bytes.get(start..start.checked_add(len as usize)?)
    }
}

/// The pairs of a [`HeaderMap`] as [`PairAt`]s; stops at the first size that does not fit.
pub struct Spans<'m> {
    map: &'m HeaderMap,
    next: usize,
    pairs: usize,
    /// Where the next pair's name starts.
    data: usize,
    /// A size did not fit the buffer.
    broken: bool,
}

impl Iterator for Spans<'_> {
    type Item = PairAt;

    fn next(&mut self) -> Option<PairAt> {
        if self.next >= self.pairs || self.broken {
            return None;
        }
        let span = self.read();
        self.broken = span.is_none();
        self.next = self.next.saturating_add(1);
        span
    }
}

impl Spans<'_> {
    fn read(&mut self) -> Option<PairAt> {
        let bytes = &self.map.bytes;
        let sizes = 4 + self.next * 8;
        let name_len = read_u32(bytes, sizes)?;
        let value_len = read_u32(bytes, sizes + 4)?;
        let name_start = self.data;
        let value_start = name_start.checked_add(name_len as usize)?.checked_add(1)?;
        let end = value_start
            .checked_add(value_len as usize)?
            .checked_add(1)?;
        if end > bytes.len() {
            return None;
        }
        self.data = end;
        Some(PairAt {
            name: (u32::try_from(name_start).ok()?, name_len),
            value: (u32::try_from(value_start).ok()?, value_len),
        })
    }
}

/// Headers that travel with every call of a fan-out (the request's forwarded ones, a reply's
/// event headers): names and values in one buffer, each pair a pair of ranges into it. Made
/// once per request with two allocations whatever the number of headers. Values are bytes,
/// carried as they came (HTTP allows any octet but CR, LF and NUL; Envoy passes obs-text
/// on); names are text (Envoy's are lower-case tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Forwarded {
    bytes: Vec<u8>,
    /// Where each name starts, where its value starts (the name ends there) and ends.
    pairs: Vec<(u32, u32, u32)>,
}

impl Forwarded {
    /// Room for `pairs` pairs of `bytes` bytes in all.
    pub fn with_capacity(pairs: usize, bytes: usize) -> Self {
        Forwarded {
            bytes: Vec::with_capacity(bytes),
            pairs: Vec::with_capacity(pairs),
        }
    }

    pub fn push(&mut self, name: &str, value: &[u8]) {
        let offset = |bytes: &Vec<u8>| u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        let name_start = offset(&self.bytes);
        self.bytes.extend_from_slice(name.as_bytes());
        let value_start = offset(&self.bytes);
        self.bytes.extend_from_slice(value);
        self.pairs
            .push((name_start, value_start, offset(&self.bytes)));
    }

    /// Every (name, value), in the order they were pushed. A name was pushed as `&str`, so
    /// reading it back as text always succeeds (a check of a few ASCII bytes).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.pairs.iter().filter_map(|&(name, value, end)| {
            let (name, value, end) = (name as usize, value as usize, end as usize);
            let name = std::str::from_utf8(self.bytes.get(name..value)?).ok()?;
            Some((name, self.bytes.get(value..end)?))
        })
    }

    /// The value of the first header named `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Owned copies of every pair (for tests and the fuzz targets, to compare).
    #[cfg(any(test, feature = "testing"))]
    pub fn to_pairs(&self) -> Vec<(String, Vec<u8>)> {
        self.iter()
            .map(|(name, value)| (name.to_string(), value.to_vec()))
            .collect()
    }
}

impl<N: AsRef<str>, V: AsRef<[u8]>> FromIterator<(N, V)> for Forwarded {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(pairs: I) -> Self {
        let mut forwarded = Forwarded::default();
        for (name, value) in pairs {
            forwarded.push(name.as_ref(), value.as_ref());
        }
        forwarded
    }
}

/// `pairs` serialized as the proxy-wasm ABI does (see [`HeaderMap`]).
pub fn serialize<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> Vec<u8> {
    let length = |b: &[u8]| u32::try_from(b.len()).unwrap_or(u32::MAX).to_le_bytes();
    // One allocation: the count, then per pair two sizes (8 bytes) and two NULs, and the text.
    let size: usize = pairs
        .iter()
        .map(|(name, value)| name.as_ref().len().saturating_add(value.as_ref().len()))
        .fold(
            pairs.len().saturating_mul(10).saturating_add(4),
            usize::saturating_add,
        );
    let mut bytes = Vec::with_capacity(size);
    bytes.extend_from_slice(&u32::try_from(pairs.len()).unwrap_or(u32::MAX).to_le_bytes());
    for (name, value) in pairs {
        bytes.extend_from_slice(&length(name.as_ref()));
        bytes.extend_from_slice(&length(value.as_ref()));
    }
    for (name, value) in pairs {
        for part in [name.as_ref(), value.as_ref()] {
            bytes.extend_from_slice(part);
            bytes.push(0);
        }
    }
    bytes
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let word = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(word.try_into().ok()?))
}

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
    exact: HashSet<Vec<u8>>,
    prefixes: Vec<String>,
    /// The exact entries that forward credentials or Envoy-internal headers, each once, in
    /// the configuration's order (for the warning).
    sensitive: Vec<String>,
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
            } else if selector.exact.insert(name.as_bytes().to_vec())
                && is_sensitive(name.as_bytes())
            {
                selector.sensitive.push(name.to_string());
            }
        }
        Ok(selector)
    }

    /// Entries that forward credentials or Envoy-internal headers, in the configuration's
    /// order, for a warning at configure time.
    pub fn sensitive_entries(&self) -> &[String] {
        &self.sensitive
    }

    /// Whether a request header (lower-case name, as Envoy hands it over) is forwarded.
    pub fn selects(&self, name: impl AsRef<[u8]>) -> bool {
        let name = name.as_ref();
        if name.starts_with(b":") || is_never_forwarded(name) {
            return false;
        }
        if self.exact.contains(name) {
            return true;
        }
        if is_sensitive(name) {
            return false;
        }
        self.prefixes
            .iter()
            .any(|prefix| name.starts_with(prefix.as_bytes()))
    }
}

fn is_never_forwarded(name: impl AsRef<[u8]>) -> bool {
    let name = name.as_ref();
    NEVER_FORWARDED.iter().any(|never| never.as_bytes() == name)
}

fn is_sensitive(name: &[u8]) -> bool {
    SENSITIVE
        .iter()
        .any(|sensitive| sensitive.as_bytes() == name)
        || name.starts_with(SENSITIVE_PREFIX.as_bytes())
}

/// A `tchar` of RFC 9110: what a header name or method may be made of.
pub fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A header value that cannot split a header block: no CR, LF or NUL (any other byte is
/// HTTP's: obs-text included).
pub fn is_valid_value(value: impl AsRef<[u8]>) -> bool {
    !value
        .as_ref()
        .iter()
        .any(|&b| b == b'\r' || b == b'\n' || b == 0)
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

    fn default_selector() -> HeaderSelector {
        HeaderSelector::new(crate::config::DEFAULT_FORWARD_HEADERS).unwrap()
    }

    #[test]
    fn a_header_map_is_read_in_place_in_envoys_order() {
        let pairs = [
            (":method", "POST"),
            ("ce-id", ""),
            ("x-a", "1"),
            ("x-a", "2"),
        ];
        let map = HeaderMap::from_serialized(serialize(&pairs)).unwrap();
        let read: Vec<(&[u8], &[u8])> = map.iter().collect();
        let want: Vec<(&[u8], &[u8])> = pairs
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
            .collect();
        assert_eq!(read, want);
        assert_eq!(map.get("x-a"), Some(&b"1"[..]), "the first of two");
        assert_eq!(map.get("ce-id"), Some(&b""[..]));
        assert_eq!(map.get("host"), None);
        let spans: Vec<PairAt> = map.spans().collect();
        assert_eq!(map.text_pair(spans[2]), Some(("x-a", "1")));
        assert_eq!(map.iter().next(), Some((&b":method"[..], &b"POST"[..])));
    }

    #[test]
    fn forwarded_headers_read_back_as_pushed() {
        let mut forwarded = Forwarded::with_capacity(1, 4);
        assert!(forwarded.is_empty());
        forwarded.push("ce-id", b"1");
        forwarded.push("x-empty", b"");
        forwarded.push("ce-source", "/é".as_bytes());
        forwarded.push("ce-greeting", b"gr\xfc\xdfe");
        let read: Vec<(&str, &[u8])> = forwarded.iter().collect();
        assert_eq!(
            read,
            [
                ("ce-id", &b"1"[..]),
                ("x-empty", b""),
                ("ce-source", "/é".as_bytes()),
                ("ce-greeting", b"gr\xfc\xdfe"),
            ]
        );
        assert_eq!(forwarded.len(), 4);
        assert_eq!(forwarded.get("ce-greeting"), Some(&b"gr\xfc\xdfe"[..]));
        assert_eq!(forwarded.get("ce-type"), None);
        let copy: Forwarded = forwarded.to_pairs().into_iter().collect();
        assert_eq!(copy, forwarded);
    }

    #[test]
    fn an_empty_serialization_is_an_empty_map() {
        for bytes in [Vec::new(), 0u32.to_le_bytes().to_vec()] {
            let map = HeaderMap::from_serialized(bytes).unwrap();
            assert_eq!(map.iter().count(), 0);
        }
    }

    #[test]
    fn a_value_that_is_not_utf8_is_read_as_bytes_and_has_no_text() {
        let map = HeaderMap::from_pairs(&[(&b"x-bin"[..], &b"\xff\x00"[..])]);
        assert_eq!(map.get("x-bin"), Some(&b"\xff\x00"[..]));
        let span = map.spans().next().unwrap();
        assert_eq!(map.text_pair(span), None);
    }

    #[test]
    fn a_malformed_serialization_is_refused_whole() {
        let good = serialize(&[("a", "1"), ("bb", "22")]);
        // Every truncation, a count larger than the pairs, a size past the end.
        for end in 1..good.len() {
            assert_eq!(
                HeaderMap::from_serialized(good[..end].to_vec()),
                None,
                "{end}"
            );
        }
        let mut more = good.clone();
        more[0] = 3;
        assert_eq!(HeaderMap::from_serialized(more), None);
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::from_serialized(huge), None);
        assert!(HeaderMap::from_serialized(good).is_some());
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
            ["authorization", "x-envoy-attempt-count"]
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
