//! The batching exporter of one VM: ended spans wait in a bounded buffer and leave in
//! batches, by size or by age, from the root context's timer, never from a request's path.
//! A collector that is down or slow costs the spans and nothing else: one export in flight
//! at a time, a full buffer drops what comes (counted, for the glue's metric), and one
//! warning per interval says how many were lost.
//!
//! Pure: the glue calls [`Exporter::record`] as spans end; on its timer, [`Exporter::tick`]
//! (an [`Export`] to dispatch, if one is due) and [`Exporter::warning`] (a line to log, if
//! one is due); and [`Exporter::answered`] with the collector's status.

use super::otlp::{self, KeyValue};
use super::span::EndedSpan;

/// What the configuration decides about exporting (validated by `config`).
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSettings {
    /// The collector's Envoy cluster.
    pub cluster: String,
    /// `:method`, `:path` and `:authority` of its OTLP/HTTP receiver, and the configured
    /// headers (a collector's API key).
    pub call_headers: Vec<(String, String)>,
    pub timeout_ms: u32,
    /// The resource every span is exported under (`service.name`, ...).
    pub resource: Vec<KeyValue>,
    /// Spans held at most; past it new spans are dropped.
    pub max_queue_spans: usize,
    /// Spans per export at most; a full batch leaves at the next tick.
    pub max_batch_spans: usize,
    /// A span waits at most this long before its batch leaves.
    pub max_delay_ms: u64,
}

/// Spans held: each one's bytes as `ScopeSpans.spans` fields (key, length, `Span`), one after
/// the other in one buffer, and where each ends.
#[derive(Debug, Default)]
struct Framed {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Framed {
    fn len(&self) -> usize {
        self.ends.len()
    }

    fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn push(&mut self, span: &[u8]) {
        otlp::frame(&mut self.bytes, span);
        self.ends.push(self.bytes.len());
    }

    /// Keeps the first `n`.
    fn truncate(&mut self, n: usize) {
        let cut = n.checked_sub(1).and_then(|i| self.ends.get(i)).copied();
        self.bytes.truncate(cut.unwrap_or(0));
        self.ends.truncate(n);
    }

    /// The first `n`, taken out.
    fn take(&mut self, n: usize) -> Vec<u8> {
        let cut = n.checked_sub(1).and_then(|i| self.ends.get(i)).copied();
        let cut = cut.unwrap_or(0).min(self.bytes.len());
        // What stays is copied out (usually nothing); what is taken keeps the buffer.
        let rest = self.bytes.split_off(cut);
        let taken = std::mem::replace(&mut self.bytes, rest);
        self.ends.drain(..n.min(self.ends.len()));
        for end in &mut self.ends {
            *end = end.saturating_sub(cut);
        }
        taken
    }
}

/// One warning about dropped spans per this many ms at most.
pub const WARNING_INTERVAL_MS: u64 = 60_000;

/// One OTLP/HTTP export call, to dispatch from the root context; its answer goes to
/// [`Exporter::answered`].
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    pub cluster: String,
    /// The settings' call headers and `content-type`.
    pub headers: Vec<(String, String)>,
    /// An `ExportTraceServiceRequest`, protobuf-encoded.
    pub body: Vec<u8>,
    pub timeout_ms: u32,
    pub spans: usize,
}

#[derive(Debug)]
pub struct Exporter {
    settings: ExportSettings,
    queue: Framed,
    /// When the oldest span in the queue was recorded.
    oldest_ms: Option<u64>,
    /// Spans of the export in flight (0: none).
    in_flight: usize,
    /// Dropped since the last [`Exporter::take_dropped`], and since the last warning.
    dropped: u64,
    unwarned: u64,
    last_warning_ms: Option<u64>,
}

impl Exporter {
    pub fn new(settings: ExportSettings) -> Exporter {
        Exporter {
            settings,
            queue: Framed::default(),
            oldest_ms: None,
            in_flight: 0,
            dropped: 0,
            unwarned: 0,
            last_warning_ms: None,
        }
    }

    /// New settings (a configuration update): the spans held and the export in flight stay;
    /// past a smaller buffer, the newest are dropped.
    pub fn reconfigure(&mut self, settings: ExportSettings) {
        let room = settings.max_queue_spans.saturating_sub(self.in_flight);
        if self.queue.len() > room {
            let over = self.queue.len() - room;
            self.queue.truncate(room);
            self.drop_spans(over);
        }
        self.settings = settings;
    }

    /// A span that ended, at `now_ms`; dropped (and counted) when the buffer is full.
    pub fn record(&mut self, span: &EndedSpan, now_ms: u64) {
        if self.queue.len() + self.in_flight >= self.settings.max_queue_spans {
            self.drop_spans(1);
            return;
        }
        self.oldest_ms.get_or_insert(now_ms);
        self.queue.push(span.as_ref());
    }

    /// The export due at `now_ms`: when a batch is full or its oldest span waited
    /// `max_delay_ms` (or, with `flush`, whatever is held: the VM is going away), if none is
    /// in flight.
    pub fn tick(&mut self, now_ms: u64, flush: bool) -> Option<Export> {
        let aged = self
            .oldest_ms
            .is_some_and(|t| now_ms.saturating_sub(t) >= self.settings.max_delay_ms);
        let full = self.queue.len() >= self.settings.max_batch_spans;
        let due = self.in_flight == 0 && !self.queue.is_empty() && (full || aged || flush);
        due.then(|| self.export(now_ms))
    }

    /// The warning due at `now_ms` (log it at warning level): when spans were dropped and
    /// none was given for an interval.
    pub fn warning(&mut self, now_ms: u64) -> Option<String> {
        let quiet = self
            .last_warning_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= WARNING_INTERVAL_MS);
        if self.unwarned == 0 || !quiet {
            return None;
        }
        let warning = format!(
            "tracing: {} spans dropped (the buffer of {} was full or the collector at \
             cluster {} failed)",
            self.unwarned, self.settings.max_queue_spans, self.settings.cluster
        );
        self.unwarned = 0;
        self.last_warning_ms = Some(now_ms);
        Some(warning)
    }

    /// The collector's answer to the export in flight: its `:status` (`None`: no answer, or
    /// the dispatch failed). Anything but 2xx loses the batch's spans.
    pub fn answered(&mut self, status: Option<u16>) {
        let spans = std::mem::take(&mut self.in_flight);
        if !status.is_some_and(|s| (200..300).contains(&s)) {
            self.drop_spans(spans);
        }
    }

    /// Spans dropped since the last call, for the glue's counter.
    pub fn take_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.dropped)
    }

    /// Spans held and not yet sent.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    fn export(&mut self, now_ms: u64) -> Export {
        let n = self.queue.len().min(self.settings.max_batch_spans);
        let batch = self.queue.take(n);
        // What stays (a full batch left) counts its age from this export: it leaves within
        // one more delay, or sooner once a batch is full again.
        self.oldest_ms = (!self.queue.is_empty()).then_some(now_ms);
        self.in_flight = n;
        let s = &self.settings;
        let mut headers = s.call_headers.clone();
        headers.push(("content-type".into(), "application/x-protobuf".into()));
        Export {
            cluster: s.cluster.clone(),
            headers,
            body: otlp::encode(&s.resource, &batch),
            timeout_ms: s.timeout_ms,
            spans: n,
        }
    }

    fn drop_spans(&mut self, n: usize) {
        let n = n as u64;
        self.dropped += n;
        self.unwarned += n;
    }
}

#[cfg(test)]
mod tests {
    use super::otlp::{ExportTraceServiceRequest, Value};
    use super::*;
    use crate::protowire::Message;

    fn settings() -> ExportSettings {
        ExportSettings {
            cluster: "otel".into(),
            call_headers: [
                (":method", "POST"),
                (":path", "/v1/traces"),
                (":authority", "otel:4318"),
                ("x-api-key", "k"),
            ]
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .to_vec(),
            timeout_ms: 1000,
            resource: vec![KeyValue::new(
                "service.name",
                Value::String("fanout".into()),
            )],
            max_queue_spans: 10,
            max_batch_spans: 4,
            max_delay_ms: 1000,
        }
    }

    fn span(n: u8) -> EndedSpan {
        EndedSpan::of(&otlp::Span {
            trace_id: vec![1; 16],
            span_id: vec![n; 8],
            name: format!("s{n}"),
            ..otlp::Span::default()
        })
    }

    fn decoded(export: &Export) -> Vec<String> {
        let request = ExportTraceServiceRequest::decode(export.body.as_slice()).unwrap();
        request.resource_spans[0].scope_spans[0]
            .spans
            .iter()
            .map(|s| s.name.clone())
            .collect()
    }

    #[test]
    fn a_batch_leaves_when_full_or_old_never_sooner() {
        let mut exporter = Exporter::new(settings());
        exporter.record(&span(1), 0);
        assert_eq!(exporter.tick(999, false), None, "neither full nor old");
        let export = exporter.tick(1000, false).unwrap();
        assert_eq!(decoded(&export), ["s1"]);
        assert_eq!(export.cluster, "otel");
        assert_eq!(export.timeout_ms, 1000);
        assert_eq!(
            export.headers,
            [
                (":method", "POST"),
                (":path", "/v1/traces"),
                (":authority", "otel:4318"),
                ("x-api-key", "k"),
                ("content-type", "application/x-protobuf"),
            ]
            .map(|(n, v)| (n.to_string(), v.to_string()))
        );
        exporter.answered(Some(200));

        for n in 0..6 {
            exporter.record(&span(n), 2000);
        }
        assert_eq!(
            decoded(&exporter.tick(2000, false).unwrap()),
            ["s0", "s1", "s2", "s3"],
            "a full batch at once"
        );
        assert_eq!(exporter.queued(), 2);
        assert_eq!(
            exporter.tick(2500, false),
            None,
            "one export in flight at a time"
        );
        exporter.answered(Some(204));
        assert_eq!(
            exporter.tick(2999, false),
            None,
            "what stayed waits from the export"
        );
        assert_eq!(decoded(&exporter.tick(3000, false).unwrap()), ["s4", "s5"]);
        exporter.answered(Some(200));
        assert_eq!(exporter.take_dropped(), 0);
        assert_eq!(
            exporter.tick(100_000, false),
            None,
            "nothing held, nothing sent"
        );
        assert_eq!(
            exporter.warning(100_000),
            None,
            "nothing dropped, nothing said"
        );
    }

    #[test]
    fn flush_sends_what_is_held() {
        let mut exporter = Exporter::new(settings());
        exporter.record(&span(1), 0);
        assert_eq!(decoded(&exporter.tick(1, true).unwrap()), ["s1"]);
    }

    #[test]
    fn a_collector_that_fails_costs_the_spans_counted_and_warned_once_per_interval() {
        let mut exporter = Exporter::new(settings());
        for n in 0..4 {
            exporter.record(&span(n), 0);
        }
        assert!(exporter.tick(0, false).is_some());
        // While the export is in flight the buffer holds 10 in all: 6 more fit.
        for n in 0..8 {
            exporter.record(&span(n), 1);
        }
        assert_eq!(exporter.queued(), 6);
        exporter.answered(None);
        assert_eq!(exporter.take_dropped(), 2 + 4);
        assert_eq!(exporter.take_dropped(), 0);
        assert!(exporter.tick(10, false).is_some());
        assert_eq!(
            exporter.warning(10).as_deref(),
            Some("tracing: 6 spans dropped (the buffer of 10 was full or the collector at cluster otel failed)")
        );
        exporter.answered(Some(503));
        assert_eq!(exporter.take_dropped(), 4);
        let before = 10 + WARNING_INTERVAL_MS - 1;
        assert_eq!(
            decoded(&exporter.tick(before, false).unwrap()),
            ["s4", "s5"],
            "the rest leaves when old"
        );
        assert_eq!(exporter.warning(before), None, "one warning per interval");
        exporter.answered(Some(200));
        let later = 10 + WARNING_INTERVAL_MS;
        assert_eq!(exporter.tick(later, false), None);
        assert!(exporter
            .warning(later)
            .is_some_and(|w| w.starts_with("tracing: 4 spans dropped")));
        assert_eq!(exporter.take_dropped(), 0, "a 2xx loses nothing");
    }
}
