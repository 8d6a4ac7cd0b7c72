//! Admission of one request, from its headers: is it a fan-out, to which channel, with which
//! headers — or which answer does it get without one. And, once the body is complete, what
//! the event is ([`PendingEvent::complete`]).
//!
//! The checks run in the order a sender can act on them: OPTIONS (answered 200, whatever the
//! host), method (405), host (400 if it is not text, 404), declared body size (413), a valid
//! CloudEvent when `require_cloudevents` is on (400), the dedupe identity (400 if it cannot be
//! read), the CloudEvents mode when the channel filters (415, 400), then the forwarded header
//! values (400 for CR, LF or NUL). Nothing here calls a subscriber.
//!
//! Header values are bytes. A value is read only where something decides on it, by the
//! CloudEvents HTTP binding's rule ([`cloudevents::text_value`]); one that cannot be read is a
//! 400 naming the header. Every other value is carried as it came.

use crate::answer::Answer;
use crate::cloudevents::{self, Attributes, ContentMode, EventError, HeaderView};
use crate::config::Identity;
use crate::config::{Config, OPTIONS};
use crate::dedupe::{self};
use crate::format::Format;
use crate::headers::{self, Forwarded, HeaderMap};

/// A request that passed admission: the body still decides (it may turn out too large).
#[derive(Debug, PartialEq, Eq)]
pub struct Admitted {
    pub channel: usize,
    /// The request headers chosen by `forward_headers`, in the order they arrived.
    pub forwarded: Forwarded,
    /// What the headers told of the event; the body completes it.
    pub event: PendingEvent,
}

/// The request's event as every reader sees it (the one view: filters, `require_cloudevents`,
/// dedupe's identity, `delivery.format`, spans), from the headers, and what its body must still
/// tell. Only what something needs is read: the attributes for a channel with filters, for
/// `delivery.format` or for `tracing`; a structured body for a filter, `require_cloudevents`,
/// dedupe's CloudEvents identity or a traced request's spans.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PendingEvent {
    /// How the request carries its CloudEvent (binary attributes already decoded); `None`:
    /// nobody looks at it, or the headers tell no mode (`unreadable`).
    pub mode: Option<ContentMode>,
    /// Why the headers tell no mode (a batch, another event format, a `content-type` that is
    /// not text), when only readers that do not refuse the request for it looked:
    /// `delivery.format` refuses it per subscriber, spans go without attributes.
    pub unreadable: Option<EventError>,
    /// The request is traced: its spans read a structured body's attributes too (set once
    /// the spans are made).
    pub traced: bool,
    /// A structured body that does not parse is rejected (400): a filter or
    /// `require_cloudevents` needs it. When only dedupe reads it, such a request has no
    /// identity and is fanned out to everyone.
    pub strict: bool,
    /// `require_cloudevents`: a structured body must be a valid CloudEvent.
    pub validate: bool,
    /// The event's identity for `dedupe`.
    pub key: EventKey,
}

/// The event's identity for `dedupe`, as far as the headers tell.
#[derive(Debug, Default, PartialEq, Eq)]
pub enum EventKey {
    /// Dedupe is off, or the request has no usable identity.
    #[default]
    None,
    /// From the headers: the key header, or a binary event's `ce-source` and `ce-id`.
    Known(Vec<u8>),
    /// In the structured body: its `source` and `id` members.
    InBody,
}

/// The event, once the body is complete: the view every reader takes it from.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// Its attributes, which the channel's filters are matched against and the spans carry:
    /// `None` when the request is not a CloudEvent or nobody read them.
    pub attributes: Option<Attributes>,
    /// Its identity for `dedupe`: `None` when dedupe is off or the request has none.
    pub key: Option<Vec<u8>>,
    /// It is a structured event (`application/cloudevents+json`), as far as anyone read.
    pub structured: bool,
    /// Why the headers told no mode (see [`PendingEvent::unreadable`]).
    pub unreadable: Option<EventError>,
}

/// Decides on a request from its headers, as Envoy hands them over (lower-case names,
/// values as bytes). `Err` is the answer to send instead of a fan-out: a rejection, or the
/// answer to OPTIONS.
pub fn admit(config: &Config, headers: &HeaderMap) -> Result<Admitted, Answer> {
    let channel = route(config, headers)?;
    let event = pending_event(config, channel, headers)?;
    // A channel nobody subscribes to forwards nothing: the selection is skipped.
    let nobody = config
        .channel(channel)
        .is_some_and(|c| c.subscribers.is_empty());
    let forwarded = if nobody {
        Forwarded::default()
    } else {
        forwarded(config, headers)?
    };
    Ok(Admitted {
        channel,
        forwarded,
        event,
    })
}

/// The checks before any of the event, in the order a sender can act on them: OPTIONS,
/// method, host, declared body size. `Ok`: the request's channel.
fn route(config: &Config, headers: &HeaderMap) -> Result<usize, Answer> {
    let method = headers.get(":method").unwrap_or_default();
    if method == OPTIONS.as_bytes() {
        return Err(options(config, headers));
    }
    if !config.methods.iter().any(|m| m.as_bytes() == method) {
        let message = format!(
            "method {} is not allowed: fanout accepts {}",
            String::from_utf8_lossy(method),
            config.allow
        );
        return Err(Answer::rejected(405, &message).with_header("allow", config.allow.clone()));
    }

    // Routing reads the authority: it must be text (no percent-decoding: it is no CloudEvents
    // attribute). Envoy's HTTP codecs pass obs-text on, so a 400 names it.
    let (authority_name, authority) = match headers.get(":authority") {
        Some(value) => (":authority", value),
        None => ("host", headers.get("host").unwrap_or_default()),
    };
    let authority = cloudevents::text_value(authority_name, authority)
        .map_err(|e| Answer::rejected(400, &e))?;
    let Some(channel) = config.router.route(&authority) else {
        return Err(Answer::rejected(
            404,
            &format!("no channel for host \"{authority}\""),
        ));
    };

    if let Some(length) = headers.get("content-length") {
        let declared = std::str::from_utf8(length)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        if let Some(declared) = declared {
            if declared > config.max_body_bytes {
                return Err(Answer::too_large(config.max_body_bytes));
            }
        }
    }
    Ok(channel)
}

/// What the headers tell of the event, as far as something reads it: `require_cloudevents`'s
/// check, dedupe's identity, the mode and attributes for a channel's filters, its
/// `delivery.format` and its spans. The headers are read once, into their [`HeaderView`],
/// for all of them.
fn pending_event(
    config: &Config,
    channel: usize,
    headers: &HeaderMap,
) -> Result<PendingEvent, Answer> {
    let filtered = config.channel(channel).filter(|c| c.filtered);
    let converts = config.channel(channel).is_some_and(|c| c.converts);
    let identity = config.dedupe.as_ref().map(|dedupe| &dedupe.key);
    let reads = config.require_cloudevents
        || filtered.is_some()
        || converts
        || config.tracing.is_some()
        || identity == Some(&Identity::CloudEvent);
    // Read from the headers Envoy already gave us: no host call.
    let view = reads.then(|| HeaderView::read(headers));
    if let (true, Some(view)) = (config.require_cloudevents, &view) {
        view.validate().map_err(|e| Answer::rejected(400, &e))?;
    }
    let key = match identity {
        None => EventKey::None,
        Some(identity) => event_key(identity, headers, view.as_ref())?,
    };
    let structured = view.as_ref().is_some_and(HeaderView::is_structured);
    let body_wanted = structured && (config.require_cloudevents || key == EventKey::InBody);
    let mut unreadable = None;
    let mode = match (view, filtered) {
        (None, _) => None,
        (Some(view), Some(filtered)) => {
            // Only the attributes some filter names must be readable.
            let reads = |attribute: &str| {
                filtered
                    .subscribers
                    .iter()
                    .any(|s| s.filter.as_ref().is_some_and(|f| f.names(attribute)))
            };
            Some(view.content_mode(reads).map_err(|e| event_rejection(&e))?)
        }
        // Readers that refuse nothing here: an attribute that is not UTF-8 is left out.
        (Some(view), None) if converts || config.tracing.is_some() => {
            match view.content_mode(|_| false) {
                Ok(mode) => Some(mode),
                Err(error) => {
                    unreadable = Some(error);
                    None
                }
            }
        }
        (Some(_), None) if body_wanted => Some(ContentMode::Structured),
        (Some(_), None) => None,
    };
    Ok(PendingEvent {
        mode,
        unreadable,
        traced: false,
        strict: filtered.is_some() || config.require_cloudevents,
        validate: config.require_cloudevents,
        key,
    })
}

/// The request headers chosen by `forward_headers`, in the order they arrived, their values
/// byte for byte: nothing reads them here. `Err` (400): a value with CR, LF or NUL, which
/// would split the header block of every call (Envoy refuses them in a request; this does
/// not rely on it), or a name that is not text (Envoy's are tokens).
fn forwarded(config: &Config, headers: &HeaderMap) -> Result<Forwarded, Answer> {
    // At most every header, at most the whole map's text: one allocation each.
    let mut forwarded = Forwarded::with_capacity(headers.len(), headers.text_bytes());
    for (name, value) in headers.iter() {
        if !config.forward.selects(name) {
            continue;
        }
        match std::str::from_utf8(name) {
            Ok(name) if headers::is_valid_value(value) => forwarded.push(name, value),
            _ => {
                return Err(Answer::rejected(
                    400,
                    &format!(
                        "header {} cannot be forwarded: its value has CR, LF or NUL",
                        String::from_utf8_lossy(name)
                    ),
                ))
            }
        }
    }
    Ok(forwarded)
}

/// The answer to OPTIONS, as Knative's channel receiver gives it: 200, `allow`, and the
/// CloudEvents webhook validation headers (HTTP webhook spec, "abuse protection"): the origin
/// a `WebHook-Request-Origin` names is allowed (any, `*`, when it names none), at any rate.
fn options(config: &Config, headers: &HeaderMap) -> Answer {
    let origin = match headers.get("webhook-request-origin") {
        None => "*".to_string(),
        // Echoed in our answer: it must be a header value that cannot split a header block
        // (Envoy refuses CR, LF and NUL in requests itself; this does not rely on it).
        Some(origin) => match String::from_utf8(origin.to_vec()) {
            Ok(origin) if headers::is_valid_value(&origin) => origin,
            _ => {
                return Answer::rejected(
                    400,
                    "header webhook-request-origin is not a UTF-8 header value",
                )
            }
        },
    };
    Answer {
        status: 200,
        headers: Vec::new(),
        body: Vec::new(),
    }
    .with_header("allow", config.allow.clone())
    .with_header("webhook-allowed-origin", origin)
    .with_header("webhook-allowed-rate", "*".to_string())
}

/// The event's identity for `dedupe`, from the headers: the key header's value, or a binary
/// event's `ce-source` and `ce-id` as their `view` read them (percent-decoded, as the binding
/// encodes them, so that a binary event and its structured copy are one event); a structured
/// event's is in its body. `Err` is the 400 naming a header that cannot be read. The key
/// header's value (read by the binding's rule, [`cloudevents::text_value`]) is the identity
/// as it came.
fn event_key(
    identity: &Identity,
    headers: &HeaderMap,
    view: Option<&HeaderView>,
) -> Result<EventKey, Answer> {
    let unreadable = |e: String| Answer::rejected(400, &e);
    let known = match (identity, view) {
        (Identity::Header(name), _) => match headers.get(name) {
            Some(value) => {
                cloudevents::text_value(name, value).map_err(unreadable)?;
                dedupe::header_key(value)
            }
            None => None,
        },
        (Identity::CloudEvent, None) => None,
        (Identity::CloudEvent, Some(view)) => {
            // The content type decides where the identity is: it must be text.
            let binary = view.identity().map_err(unreadable)?;
            if view.is_structured() {
                return Ok(EventKey::InBody);
            }
            binary.and_then(|(source, id)| dedupe::cloudevent_key(source.as_bytes(), id.as_bytes()))
        }
    };
    Ok(known.map_or(EventKey::None, EventKey::Known))
}

impl PendingEvent {
    /// The event, once the body is complete. A structured body is parsed here, once, and only
    /// when something reads it; `Err` is its 400 (or 415) when a filter or
    /// `require_cloudevents` needs it and it is not a (valid) structured CloudEvent.
    pub fn complete(self, body: &[u8]) -> Result<Event, Answer> {
        let key_in_body = self.key == EventKey::InBody;
        let mut key = match self.key {
            EventKey::Known(key) => Some(key),
            EventKey::None | EventKey::InBody => None,
        };
        let structured = self.mode == Some(ContentMode::Structured);
        // `delivery.format` alone converts the body as it is: it is not parsed for it.
        let body_read = self.strict || key_in_body || self.traced;
        let attributes = match self.mode {
            None | Some(ContentMode::NotCloudEvent) => None,
            Some(ContentMode::Binary(attributes)) => Some(attributes),
            Some(ContentMode::Structured) if !body_read => None,
            Some(ContentMode::Structured) => match cloudevents::parse_structured_event(body) {
                Ok(event) => {
                    if self.validate {
                        event.validate().map_err(|e| Answer::rejected(400, &e))?;
                    }
                    if key_in_body {
                        key = event.required("source").zip(event.required("id")).and_then(
                            |(source, id)| dedupe::cloudevent_key(source.as_bytes(), id.as_bytes()),
                        );
                    }
                    Some(event.attributes)
                }
                Err(error) if self.strict => return Err(event_rejection(&error)),
                Err(_) => None,
            },
        };
        Ok(Event {
            attributes,
            key,
            structured,
            unreadable: self.unreadable,
        })
    }
}

impl Event {
    /// The content mode it came in, as `delivery.format` converts from it
    /// ([`format::incoming`](crate::format::incoming)). `Err`: why it cannot be converted.
    pub fn format(&self) -> Result<Format, String> {
        crate::format::incoming(
            self.structured,
            self.attributes.as_ref(),
            self.unreadable.as_ref(),
        )
    }
}

/// A batch or another event format cannot be filtered: 415. A malformed event: 400.
fn event_rejection(error: &EventError) -> Answer {
    let status = match error {
        EventError::Unsupported(_) => 415,
        EventError::Malformed(_) => 400,
    };
    Answer::rejected(status, &error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MAX_KEY_BYTES;

    fn config() -> Config {
        Config::from_json(
            br#"{"max_body_bytes": 100, "methods": ["POST", "PUT"],
                 "channels": [
                   {"name": "orders", "hosts": ["orders.default"], "subscribers": [{"cluster": "a"}]},
                   {"name": "payments", "hosts": ["payments.default"], "subscribers": []}
                 ]}"#,
        )
        .unwrap()
    }

    /// `admit` on the headers as Envoy serializes them.
    fn admit(config: &Config, headers: Vec<(String, Vec<u8>)>) -> Result<Admitted, Answer> {
        super::admit(config, &HeaderMap::from_pairs(&headers))
    }

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    fn status(result: Result<Admitted, Answer>) -> u32 {
        match result {
            Ok(_) => 0,
            Err(answer) => answer.status,
        }
    }

    #[test]
    fn admission_table() {
        let config = config();
        let cases: &[(&[(&str, &str)], u32)] = &[
            (&[(":method", "POST"), (":authority", "orders.default")], 0),
            (
                &[(":method", "PUT"), (":authority", "payments.default:80")],
                0,
            ),
            (&[(":method", "GET"), (":authority", "orders.default")], 405),
            (
                &[(":method", "post"), (":authority", "orders.default")],
                405,
            ),
            (&[(":authority", "orders.default")], 405),
            (
                &[(":method", "POST"), (":authority", "nobody.default")],
                404,
            ),
            (&[(":method", "POST")], 404),
            (&[(":method", "POST"), ("host", "Orders.Default")], 0),
            (
                &[
                    (":method", "POST"),
                    (":authority", "orders.default"),
                    ("content-length", "101"),
                ],
                413,
            ),
            (
                &[
                    (":method", "POST"),
                    (":authority", "orders.default"),
                    ("content-length", "100"),
                ],
                0,
            ),
            // a method check comes before the host check
            (&[(":method", "GET"), (":authority", "nobody")], 405),
        ];
        for (pairs, want) in cases {
            assert_eq!(status(admit(&config, headers(pairs))), *want, "{pairs:?}");
        }
    }

    #[test]
    fn routes_to_the_channel_of_the_host() {
        let config = config();
        let admitted = admit(
            &config,
            headers(&[(":method", "POST"), (":authority", "PAYMENTS.default:8080")]),
        )
        .unwrap();
        assert_eq!(admitted.channel, 1);
    }

    #[test]
    fn forwards_only_selected_headers_in_order() {
        let config = config();
        let admitted = admit(
            &config,
            headers(&[
                (":method", "POST"),
                (":authority", "orders.default"),
                (":path", "/"),
                ("content-type", "application/json"),
                ("authorization", "Bearer secret"),
                ("cookie", "a=b"),
                ("ce-id", "1"),
                ("x-unlisted", "no"),
                ("content-length", "2"),
                ("x-request-id", "r1"),
            ]),
        )
        .unwrap();
        assert_eq!(
            admitted.forwarded.to_pairs(),
            vec![
                ("content-type".to_string(), b"application/json".to_vec()),
                ("ce-id".to_string(), b"1".to_vec()),
                ("x-request-id".to_string(), b"r1".to_vec()),
            ]
        );
    }

    fn filtered_config() -> Config {
        Config::from_json(
            br#"{"channels": [
                   {"name": "filtered", "hosts": ["f"], "subscribers": [
                     {"cluster": "a", "filters": [{"exact": {"type": "t"}}]}, {"cluster": "b"}]},
                   {"name": "plain", "hosts": ["p"], "subscribers": [{"cluster": "c"}]}
                 ]}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_event_mode_is_read_only_when_the_channel_filters() {
        let config = filtered_config();
        let request = |host: &str, extra: &[(&str, &str)]| {
            let mut h = headers(&[(":method", "POST"), (":authority", host)]);
            h.extend(headers(extra));
            admit(&config, h)
        };
        let binary = request("f", &[("ce-type", "t%21"), ("ce-id", "1")]).unwrap();
        assert_eq!(
            binary.event.mode,
            Some(ContentMode::Binary(Attributes::from([
                ("type", "t!"),
                ("id", "1")
            ])))
        );
        assert!(binary.event.strict);
        let structured = request("f", &[("content-type", "application/cloudevents+json")]).unwrap();
        assert_eq!(structured.event.mode, Some(ContentMode::Structured));
        assert_eq!(
            request("f", &[]).unwrap().event.mode,
            Some(ContentMode::NotCloudEvent)
        );
        // A channel without filters never looks: no mode, no 415, no 400.
        assert_eq!(
            request("p", &[("ce-type", "t")]).unwrap().event,
            PendingEvent::default()
        );
        let structured = request("p", &[("content-type", "application/cloudevents+json")]).unwrap();
        assert_eq!(structured.event, PendingEvent::default());
        let batch = [("content-type", "application/cloudevents-batch+json")];
        assert!(request("p", &batch).is_ok());
        assert!(request("p", &[("ce-type", "t"), ("ce-id", "%ff")]).is_ok());

        let answer = request("f", &batch).unwrap_err();
        assert_eq!(answer.status, 415);
        assert!(String::from_utf8(answer.body).unwrap().contains("batch"));
        // Only what a filter names must be readable: the filters here read `type`.
        let answer = request("f", &[("ce-type", "%ff"), ("ce-id", "1")]).unwrap_err();
        assert_eq!(answer.status, 400);
        assert!(String::from_utf8(answer.body).unwrap().contains("ce-type"));
        let unread = request("f", &[("ce-type", "t"), ("ce-id", "%ff")]).unwrap();
        assert_eq!(
            unread.event.mode,
            Some(ContentMode::Binary(Attributes::from([("type", "t")]))),
            "an attribute nobody reads is left out, its header carried"
        );
        assert_eq!(unread.forwarded.get("ce-id"), Some(&b"%ff"[..]));
    }

    fn structured() -> PendingEvent {
        PendingEvent {
            mode: Some(ContentMode::Structured),
            strict: true,
            ..PendingEvent::default()
        }
    }

    #[test]
    fn complete_parses_a_structured_body_or_answers_400() {
        assert_eq!(
            PendingEvent::default().complete(b"{not json"),
            Ok(Event::default())
        );
        assert_eq!(
            structured()
                .complete(br#"{"type": "t", "data": {}}"#)
                .unwrap()
                .attributes,
            Some(Attributes::from([("type", "t")]))
        );
        let answer = structured().complete(b"{not json").unwrap_err();
        assert_eq!(answer.status, 400);
    }

    fn admit_with(config: &Config, extra: &[(&str, &str)]) -> Result<Admitted, Answer> {
        let mut h = headers(&[(":method", "POST"), (":authority", "x")]);
        h.extend(headers(extra));
        admit(config, h)
    }

    fn key(config: &Config, extra: &[(&str, &str)], body: &[u8]) -> Option<Vec<u8>> {
        admit_with(config, extra)
            .unwrap()
            .event
            .complete(body)
            .unwrap()
            .key
    }

    #[test]
    fn the_dedupe_key_is_taken_only_when_dedupe_is_on() {
        let ce = [("ce-source", "/s"), ("ce-id", "c1")];
        let off = Config::from_json(br#"{"subscribers": []}"#).unwrap();
        assert_eq!(
            admit_with(&off, &ce).unwrap().event,
            PendingEvent::default()
        );
        let on = Config::from_json(br#"{"dedupe": {}, "subscribers": []}"#).unwrap();
        assert_eq!(key(&on, &ce, b""), Some(b"2:/sc1".to_vec()));
    }

    #[test]
    fn a_key_header_names_the_event_by_its_value_alone() {
        let on =
            Config::from_json(br#"{"dedupe": {"key": "X-Event"}, "subscribers": []}"#).unwrap();
        let h = |key: &str| [("x-event", key.to_string()), ("ce-id", "c1".to_string())];
        let with = |key: &str| {
            let pairs = h(key);
            let pairs: Vec<(&str, &str)> = pairs.iter().map(|(n, v)| (*n, v.as_str())).collect();
            self::key(&on, &pairs, b"")
        };
        assert_eq!(with("e1"), Some(b"e1".to_vec()));
        assert_eq!(with(""), None);
        assert_eq!(with(&"k".repeat(MAX_KEY_BYTES + 1)), None);
        // `"key": "ce-id"` keeps the id alone, whatever the source.
        let ce_id =
            Config::from_json(br#"{"dedupe": {"key": "ce-id"}, "subscribers": []}"#).unwrap();
        assert_eq!(
            key(&ce_id, &[("ce-id", "1"), ("ce-source", "/a")], b""),
            key(&ce_id, &[("ce-id", "1"), ("ce-source", "/b")], b"")
        );
        // A structured body is not read for a key header.
        let ct = ("content-type", "application/cloudevents+json");
        assert_eq!(admit_with(&on, &[ct]).unwrap().event.mode, None);
    }

    #[test]
    fn the_cloudevents_identity_is_source_and_id_in_both_modes() {
        let on = Config::from_json(br#"{"dedupe": {}, "subscribers": []}"#).unwrap();
        // Binary: the headers, percent-decoded as the binding encodes them.
        let binary =
            |source: &str, id: &str| key(&on, &[("ce-source", source), ("ce-id", id)], b"");
        assert_eq!(binary("/a", "1"), Some(b"2:/a1".to_vec()));
        assert_ne!(binary("/a", "1"), binary("/b", "1"));
        assert_eq!(binary("%2Fa%20b", "1"), Some(b"4:/a b1".to_vec()));
        assert_eq!(key(&on, &[("ce-id", "1")], b""), None);
        assert_eq!(key(&on, &[("ce-source", "/a")], b""), None);
        assert_eq!(binary("", "1"), None);
        // Structured: the body's members, parsed only because dedupe needs them.
        let ct = [(
            "content-type",
            "application/cloudevents+json; charset=utf-8",
        )];
        let admitted = admit_with(&on, &ct).unwrap();
        assert_eq!(admitted.event.key, EventKey::InBody);
        assert_eq!(admitted.event.mode, Some(ContentMode::Structured));
        assert!(!admitted.event.strict);
        let body = |json: &str| key(&on, &ct, json.as_bytes());
        assert_eq!(
            body(r#"{"source": "/a b", "id": "1", "data": {"id": "x"}}"#),
            binary("%2Fa%20b", "1"),
            "a structured event and its binary copy are one event"
        );
        assert_ne!(
            body(r#"{"source": "/a", "id": "1"}"#),
            body(r#"{"source": "/b", "id": "1"}"#)
        );
        // No identity, and no 400 either: dedupe alone never rejects.
        assert_eq!(body(r#"{"id": "1"}"#), None);
        assert_eq!(body(r#"{"source": "/a", "id": 1}"#), None);
        assert_eq!(body(r#"{"source": "/a", "id": ""}"#), None);
        assert_eq!(body("{not json"), None);
        // A batch has no one identity.
        let batch = [("content-type", "application/cloudevents-batch+json")];
        assert_eq!(key(&on, &batch, b"[]"), None);
    }

    /// A quoted-string (how older senders write `ce-*` values) and the percent-encoding of the
    /// same value are one attribute value to every reader: filters, `require_cloudevents`,
    /// dedupe's identity, `delivery.format`, and the reading of a subscriber's reply.
    #[test]
    fn a_quoted_value_is_read_the_same_by_every_reader() {
        let quoted = [
            ("ce-specversion", r#""1.0""#),
            ("ce-id", r#""a b\"c""#),
            ("ce-source", r#""/s""#),
            ("ce-type", r#""t""#),
        ];
        let encoded = [
            ("ce-specversion", "1.0"),
            ("ce-id", "a%20b%22c"),
            ("ce-source", "/s"),
            ("ce-type", "t"),
        ];
        let config = Config::from_json(
            br#"{"require_cloudevents": true, "dedupe": {}, "subscribers": [
                   {"cluster": "a",
                    "filters": [{"exact": {"id": "a b\"c"}}, {"exact": {"type": "t"}}]}]}"#,
        )
        .unwrap();
        let admitted = |pairs: &[(&str, &str)]| admit_with(&config, pairs).unwrap().event;
        let (from_quoted, from_encoded) = (admitted(&quoted), admitted(&encoded));
        let Some(ContentMode::Binary(attributes)) = &from_quoted.mode else {
            panic!("not binary mode: {from_quoted:?}");
        };
        assert_eq!(attributes.get("id"), Some("a b\"c"));
        let filter = config
            .channel(0)
            .and_then(|c| c.subscribers[0].filter.as_ref());
        assert!(crate::event_filter::accepts(filter, Some(attributes)));
        assert_eq!(from_quoted, from_encoded, "attributes and identity");
        assert_eq!(from_quoted.key, EventKey::Known(b"2:/sa b\"c".to_vec()));
        assert_eq!(
            cloudevents::validate_headers(&HeaderMap::from_pairs(&quoted)),
            Ok(())
        );
        let as_pairs = |pairs: &[(&'static str, &'static str)]| -> Vec<(&[u8], &[u8])> {
            pairs
                .iter()
                .map(|(n, v)| (n.as_bytes(), v.as_bytes()))
                .collect()
        };
        let structured = |pairs| {
            let converted =
                crate::format::convert(crate::format::Format::Structured, &as_pairs(pairs), b"");
            converted.unwrap().body
        };
        assert_eq!(structured(&quoted), structured(&encoded));
        let reply = |pairs: &[(&str, &str)]| crate::reply::read(headers(pairs), 0, 100);
        assert!(matches!(reply(&quoted), crate::reply::Replied::Event(_)));
        assert!(matches!(reply(&encoded), crate::reply::Replied::Event(_)));
    }

    fn strict() -> Config {
        Config::from_json(br#"{"require_cloudevents": true, "subscribers": []}"#).unwrap()
    }

    fn rejection<T: std::fmt::Debug>(result: Result<T, Answer>) -> (u32, String) {
        match result {
            Ok(admitted) => panic!("admitted: {admitted:?}"),
            Err(answer) => {
                let doc: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
                (answer.status, doc["error"].as_str().unwrap().to_string())
            }
        }
    }

    const VALID_BINARY: [(&str, &str); 4] = [
        ("ce-specversion", "1.0"),
        ("ce-id", "1"),
        ("ce-source", "/s"),
        ("ce-type", "t"),
    ];

    #[test]
    fn require_cloudevents_admits_valid_binary_events_only() {
        let config = strict();
        assert!(admit_with(&config, &VALID_BINARY).is_ok());
        let mut v03 = VALID_BINARY;
        v03[0].1 = "0.3";
        assert!(admit_with(&config, &v03).is_ok());
        let without = |name: &'static str| -> Vec<(&'static str, &'static str)> {
            VALID_BINARY
                .iter()
                .copied()
                .filter(|(n, _)| *n != name)
                .collect()
        };
        let with = |name: &'static str, value: &'static str| -> Vec<(&'static str, &'static str)> {
            let mut h = without(name);
            h.push((name, value));
            h
        };
        let cases: Vec<(Vec<(&'static str, &'static str)>, &str)> = vec![
            (without("ce-specversion"), "ce-specversion is missing"),
            (without("ce-id"), "ce-id is missing"),
            (without("ce-source"), "ce-source is missing"),
            (without("ce-type"), "ce-type is missing"),
            (with("ce-id", ""), "ce-id is empty"),
            (with("ce-type", ""), "ce-type is empty"),
            (
                with("ce-specversion", "2.0"),
                "ce-specversion is \"2.0\", not one of 1.0, 0.3",
            ),
            (
                with("ce-source", "%FF"),
                "ce-source is not UTF-8 once percent-decoded",
            ),
            // An extension is an attribute too: the binding's rule is the same.
            (
                {
                    let mut h = VALID_BINARY.to_vec();
                    h.push(("ce-greeting", "gr%FCn"));
                    h
                },
                "header ce-greeting is not UTF-8 once percent-decoded",
            ),
            (
                vec![("ce-id", "1")],
                "not a valid CloudEvent (binary mode): ce-specversion is missing, ce-source \
                 is missing, ce-type is missing",
            ),
            (vec![], "not a CloudEvent: neither the headers"),
            (
                vec![("content-type", "application/json")],
                "not a CloudEvent: neither the headers",
            ),
            (
                vec![("content-type", "application/cloudevents-batch+json")],
                "not one valid CloudEvent: application/cloudevents-batch+json",
            ),
            (
                vec![("content-type", "application/cloudevents+avro")],
                "not one valid CloudEvent",
            ),
        ];
        for (extra, want) in cases {
            let (status, error) = rejection(admit_with(&config, &extra));
            assert_eq!(status, 400, "{extra:?}");
            assert!(
                error.contains(want),
                "{extra:?}\n  gave: {error}\n  want: {want}"
            );
        }
        // Off (the default): anything goes.
        let off = Config::from_json(br#"{"subscribers": []}"#).unwrap();
        assert!(admit_with(&off, &[("content-type", "application/json")]).is_ok());
    }

    #[test]
    fn require_cloudevents_validates_a_structured_body() {
        let config = strict();
        let ct = [("content-type", "application/cloudevents+json")];
        let admitted = admit_with(&config, &ct).unwrap();
        assert_eq!(admitted.event.mode, Some(ContentMode::Structured));
        assert!(admitted.event.strict && admitted.event.validate);
        let complete = |body: &str| {
            admit_with(&config, &ct)
                .unwrap()
                .event
                .complete(body.as_bytes())
        };
        let valid = r#"{"specversion": "1.0", "id": "1", "source": "/s", "type": "t", "data": 1}"#;
        assert!(complete(valid).is_ok());
        assert!(complete(&valid.replace("1.0", "0.3")).is_ok());
        let cases = [
            (
                r#"{"id": "1", "source": "/s", "type": "t"}"#,
                "member specversion is missing",
            ),
            (
                r#"{"specversion": "1.0", "id": 1, "source": "/s", "type": "t"}"#,
                "member id is not a string",
            ),
            (
                r#"{"specversion": "1.0", "id": "1", "source": null, "type": "t"}"#,
                "member source is not a string",
            ),
            (
                r#"{"specversion": "1.0", "id": "1", "source": "/s", "type": ""}"#,
                "member type is empty",
            ),
            (
                r#"{"specversion": 1.0, "id": "1", "source": "/s", "type": "t"}"#,
                "member specversion is not a string",
            ),
            (
                r#"{"specversion": "1", "id": "1", "source": "/s", "type": "t"}"#,
                "member specversion is \"1\", not one of 1.0, 0.3",
            ),
            (
                r#"{"data": {"specversion": "1.0", "id": "1", "source": "/s", "type": "t"}}"#,
                "not a valid CloudEvent (structured mode): member specversion is missing, \
                 member id is missing, member source is missing, member type is missing",
            ),
            ("{not json", "the body is not a structured CloudEvent"),
            ("[]", "the body is not a structured CloudEvent"),
        ];
        for (body, want) in cases {
            let (status, error) = rejection(complete(body));
            assert_eq!(status, 400, "{body}");
            assert!(
                error.contains(want),
                "{body}\n  gave: {error}\n  want: {want}"
            );
        }
    }

    #[test]
    fn options_is_answered_200_with_allow_and_the_webhook_headers() {
        let answer = admit(
            &config(),
            headers(&[
                (":method", "OPTIONS"),
                (":authority", "orders.default"),
                ("webhook-request-origin", "eventemitter.example.com"),
            ]),
        )
        .unwrap_err();
        assert_eq!(answer.status, 200);
        assert!(answer.body.is_empty());
        assert_eq!(
            answer.header_pairs(),
            [
                ("allow", "POST, PUT, OPTIONS"),
                ("webhook-allowed-origin", "eventemitter.example.com"),
                ("webhook-allowed-rate", "*"),
            ]
        );
        // Without an origin: any; whatever the host (as Knative's receiver, before routing).
        let answer = admit(
            &config(),
            headers(&[(":method", "OPTIONS"), (":authority", "nobody")]),
        )
        .unwrap_err();
        assert_eq!(answer.status, 200);
        assert!(answer
            .headers
            .contains(&("webhook-allowed-origin", "*".to_string())));
        for bad in [&[0xff][..], b"a\r\nx-evil: 1"] {
            let mut h = headers(&[(":method", "OPTIONS")]);
            h.push(("webhook-request-origin".to_string(), bad.to_vec()));
            let answer = admit(&config(), h).unwrap_err();
            assert_eq!(answer.status, 400);
            assert_eq!(answer.headers.len(), 1, "{answer:?}");
        }
    }

    #[test]
    fn method_not_allowed_lists_the_allowed_ones() {
        let answer = admit(
            &config(),
            headers(&[(":method", "GET"), (":authority", "orders.default")]),
        )
        .unwrap_err();
        assert!(answer
            .headers
            .contains(&("allow", "POST, PUT, OPTIONS".to_string())));
        let text = String::from_utf8(answer.body).unwrap();
        assert!(text.contains("method GET is not allowed"), "{text}");
    }

    #[test]
    fn unknown_host_is_named_in_the_404() {
        let answer = admit(
            &config(),
            headers(&[(":method", "POST"), (":authority", "nobody.default")]),
        )
        .unwrap_err();
        let text = String::from_utf8(answer.body).unwrap();
        assert!(text.contains("nobody.default"), "{text}");
    }

    #[test]
    fn a_forwarded_value_goes_on_byte_for_byte_and_only_cr_lf_nul_are_refused() {
        let request = |host: &str, extra: (&str, &[u8])| {
            let mut h = headers(&[(":method", "POST"), (":authority", host)]);
            h.push((extra.0.to_string(), extra.1.to_vec()));
            admit(&config(), h)
        };
        let admitted = request("orders.default", ("ce-source", &[0xff, 0xfe])).unwrap();
        assert_eq!(
            admitted.forwarded.to_pairs(),
            [("ce-source".to_string(), vec![0xff, 0xfe])]
        );
        for bad in [&b"a\r\nb"[..], b"a\nb", b"a\0b"] {
            let answer = request("orders.default", ("ce-source", bad)).unwrap_err();
            assert_eq!(answer.status, 400);
            assert!(String::from_utf8(answer.body)
                .unwrap()
                .contains("ce-source"));
            // One that is not forwarded does not matter.
            assert!(request("orders.default", ("x-unlisted", bad)).is_ok());
        }
        // A channel nobody subscribes to forwards nothing and reads nothing more.
        let admitted = request("payments.default", ("ce-source", &[0xff])).unwrap();
        assert!(admitted.forwarded.is_empty());
    }

    #[test]
    fn an_authority_that_is_not_utf8_is_a_400_naming_it() {
        for name in [":authority", "host"] {
            let mut h = headers(&[(":method", "POST")]);
            h.push((name.to_string(), b"orders.default\xe9".to_vec()));
            let (status, error) = rejection(admit(&config(), h));
            assert_eq!(status, 400);
            assert!(
                error.contains(&format!("header {name} is not UTF-8")),
                "{error}"
            );
        }
    }
}
