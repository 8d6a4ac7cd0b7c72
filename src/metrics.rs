//! What `fanout` counts, and the names it reports them under in Envoy's stats.
//!
//! Counting happens in plain memory: streams add to one [`Tally`] per worker (shared with the
//! root context), and the root context hands the totals to Envoy on a timer. A request costs
//! no host call for its counters; only the durations need the host's clock. Envoy keeps stats
//! by name for the whole process, so the workers' tallies add up there.
//!
//! The names, their kinds and what each counts are the README's table ("Metrics"); Envoy
//! shows them with its `wasmcustom.` prefix in `/stats`.
//!
//! `<cluster>` is the cluster name with every character other than letters, digits, `_` and
//! `-` replaced by `_`: Envoy splits stat names on `.`, and an Istio cluster name such as
//! `outbound|80||billing.default.svc.cluster.local` would otherwise become many segments.

use hashbrown::HashMap;

use crate::call::Failure;

/// Samples per histogram at which the root context flushes at once instead of at its next
/// tick (see [`Tally::wants_flush`]). A histogram keeps at most four times this many between
/// flushes; a sample past that is counted in `fanout.metrics.samples_dropped`, not kept.
pub const HISTOGRAM_BUFFER: usize = 4096;

/// The kinds of metric Envoy offers a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Why a subscriber call (or a reply) failed, as a stat name segment.
pub fn failure_kind(failure: &Failure) -> &'static str {
    FAILURE_KINDS
        .get(failure_index(failure))
        .map_or("", |kind| kind)
}

fn failure_index(failure: &Failure) -> usize {
    match failure {
        Failure::Status { status, .. } => match status {
            400..=499 => 0,
            500..=599 => 1,
            _ => 2,
        },
        Failure::Timeout => 3,
        Failure::Reset { .. } => 4,
        Failure::NoResponse => 5,
        Failure::DispatchError { .. } => 6,
        Failure::Overflow { .. } => 7,
        Failure::TooLarge { .. } => 8,
    }
}

/// A cluster name made safe as one stat name segment.
pub fn stat_segment(cluster: &str) -> String {
    let segment: String = cluster
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if segment.is_empty() {
        "_".to_string()
    } else {
        segment
    }
}

/// Counts of one worker since the last flush. Counters are numbered as they are first used,
/// so counting is an index into a vector; names are made once per counter.
#[derive(Debug, Default)]
pub struct Tally {
    names: Vec<String>,
    counts: Vec<u64>,
    by_name: HashMap<String, usize>,
    /// Each cluster calls are counted under, by the index [`Tally::cluster`] gave it (fixed
    /// at configure time, so that counting a call looks nothing up by name); its counters
    /// are made at its first count, or by [`Tally::register_subscriber`].
    clusters: Vec<(String, Option<SubscriberCounters>)>,
    cluster_index: HashMap<String, usize>,
    replies: HashMap<String, ReplyCounters>,
    in_flight_delta: i64,
    fanout_ms: Vec<u64>,
    call_ms: Vec<u64>,
    dedupe: bool,
    dedupe_entries_delta: i64,
    /// Gauges by name (the per-subscriber calls in flight and waiting, with
    /// `max_concurrent_calls`) and their change since the last flush, in the order they
    /// were registered (a list: a few per capped subscriber, and no map's code in the module).
    gauges: Vec<(String, i64)>,
}

/// Counter numbers of one subscriber cluster.
#[derive(Debug, Clone, Copy)]
struct SubscriberCounters {
    calls: usize,
    delivered: usize,
    retries: usize,
    dead_lettered: usize,
    skipped: usize,
    /// In the order of [`FAILURE_KINDS`]; a call never fails `too_large`.
    failed: [usize; CALL_FAILURE_KINDS],
}

/// Counter numbers of the replies of one subscriber cluster (one with a reply target).
#[derive(Debug, Clone, Copy)]
struct ReplyCounters {
    discarded: usize,
    /// In the order of [`FAILURE_KINDS`].
    failed: [usize; FAILURE_KINDS.len()],
}

const FAILURE_KINDS: [&str; 9] = [
    "status_4xx",
    "status_5xx",
    "status_other",
    "timeout",
    "reset",
    "no_response",
    "dispatch_error",
    "overflow",
    "too_large",
];
/// The first kinds: those a call can fail with (`too_large` is a reply's own).
const CALL_FAILURE_KINDS: usize = 8;

/// What a flush hands to Envoy.
#[derive(Debug, Default, PartialEq)]
pub struct Flush {
    /// Counter (its index in [`Tally::counter_names`]) and how much to add.
    pub counters: Vec<(usize, u64)>,
    /// Change of the in-flight gauge (each worker adds its own change).
    pub in_flight_delta: i64,
    pub fanout_ms: Vec<u64>,
    pub call_ms: Vec<u64>,
    /// Change of the dedupe entries gauge.
    pub dedupe_entries_delta: i64,
    /// Other gauges that changed: name and change.
    pub gauges: Vec<(String, i64)>,
}

pub const IN_FLIGHT: &str = "fanout.in_flight";
pub const FANOUT_DURATION: &str = "fanout.duration_ms";
pub const CALL_DURATION: &str = "fanout.call_duration_ms";
const RECEIVED: &str = "fanout.requests.received";
const ACCEPTED: &str = "fanout.requests.accepted";
const FAILED: &str = "fanout.requests.failed";
const REACHED_ROUTER: &str = "fanout.requests.reached_router";
const OPTIONS: &str = "fanout.requests.options";
const UNDELIVERED: &str = "fanout.requests.undelivered";
pub const DEDUPE_ENTRIES: &str = "fanout.dedupe.entries";
const DEDUPE_MISSING_KEY: &str = "fanout.dedupe.missing_key";
const DEDUPE_SKIPPED: &str = "fanout.dedupe.skipped";
const DEDUPE_IN_PROGRESS: &str = "fanout.dedupe.in_progress";
const DEDUPE_STORE_ERRORS: &str = "fanout.dedupe.store_errors";
const SAMPLES_DROPPED: &str = "fanout.metrics.samples_dropped";
const SPANS_DROPPED: &str = "fanout.tracing.spans_dropped";

impl Tally {
    fn counter(&mut self, name: &str) -> usize {
        if let Some(&id) = self.by_name.get(name) {
            return id;
        }
        let id = self.names.len();
        self.names.push(name.to_string());
        self.counts.push(0);
        self.by_name.insert(name.to_string(), id);
        id
    }

    fn bump(&mut self, id: usize) {
        self.add(id, 1);
    }

    fn add(&mut self, id: usize, n: u64) {
        if let Some(count) = self.counts.get_mut(id) {
            *count = count.saturating_add(n);
        }
    }

    /// The index under which calls to `cluster` are counted: the same for as long as the
    /// tally lives, whichever configuration asks. The plugin asks at configure time and keeps
    /// it with the subscriber (`config::Subscriber::stats`).
    pub fn cluster(&mut self, cluster: &str) -> usize {
        if let Some(&at) = self.cluster_index.get(cluster) {
            return at;
        }
        let at = self.clusters.len();
        self.clusters.push((cluster.to_string(), None));
        self.cluster_index.insert(cluster.to_string(), at);
        at
    }

    /// The counter `pick` names among those of the cluster at index `at` (made at its first
    /// use); `None`: no such index, which counts nothing. In line: two per call.
    #[inline]
    fn subscriber(
        &mut self,
        at: usize,
        pick: impl FnOnce(&SubscriberCounters) -> Option<usize>,
    ) -> Option<usize> {
        if let Some((_, Some(ids))) = self.clusters.get(at) {
            return pick(ids);
        }
        pick(&self.make_subscriber(at)?)
    }

    /// The counters of the cluster at index `at`, made (once per cluster: out of line).
    #[cold]
    #[inline(never)]
    fn make_subscriber(&mut self, at: usize) -> Option<SubscriberCounters> {
        let (cluster, _) = self.clusters.get(at)?;
        let prefix = format!("fanout.subscriber.{}", stat_segment(cluster));
        let mut ids = SubscriberCounters {
            calls: self.counter(&format!("{prefix}.calls")),
            delivered: self.counter(&format!("{prefix}.delivered")),
            retries: self.counter(&format!("{prefix}.retries")),
            dead_lettered: self.counter(&format!("{prefix}.dead_lettered")),
            skipped: self.counter(&format!("{prefix}.skipped")),
            failed: [0; CALL_FAILURE_KINDS],
        };
        for (id, kind) in ids.failed.iter_mut().zip(FAILURE_KINDS) {
            *id = self.counter(&format!("{prefix}.failed.{kind}"));
        }
        if let Some((_, slot)) = self.clusters.get_mut(at) {
            *slot = Some(ids);
        }
        Some(ids)
    }

    fn replies(&mut self, cluster: &str) -> ReplyCounters {
        if let Some(&ids) = self.replies.get(cluster) {
            return ids;
        }
        let prefix = format!("fanout.subscriber.{}", stat_segment(cluster));
        let ids = ReplyCounters {
            discarded: self.counter(&format!("{prefix}.reply_discarded")),
            failed: FAILURE_KINDS
                .map(|kind| self.counter(&format!("{prefix}.reply_failed.{kind}"))),
        };
        self.replies.insert(cluster.to_string(), ids);
        ids
    }

    /// Makes the request counters exist (at zero) before the first request.
    pub fn register_requests(&mut self) {
        for name in [
            RECEIVED,
            ACCEPTED,
            FAILED,
            REACHED_ROUTER,
            UNDELIVERED,
            OPTIONS,
            SAMPLES_DROPPED,
        ] {
            self.counter(name);
        }
    }

    pub fn received(&mut self) {
        let id = self.counter(RECEIVED);
        self.bump(id);
    }

    /// A request was answered: 202, the 500 report, a rejection, or the 200 to OPTIONS (the
    /// only 200 the filter answers).
    pub fn answered(&mut self, status: u32) {
        let id = match status {
            202 => self.counter(ACCEPTED),
            500 => self.counter(FAILED),
            200 => self.counter(OPTIONS),
            other => self.counter(&format!("fanout.requests.rejected.{other}")),
        };
        self.bump(id);
    }

    /// Makes the tracing counter exist (at zero).
    pub fn register_tracing(&mut self) {
        self.counter(SPANS_DROPPED);
    }

    /// Spans the exporter could not keep or send (`tracing`).
    pub fn spans_dropped(&mut self, n: u64) {
        let id = self.counter(SPANS_DROPPED);
        self.add(id, n);
    }

    /// A request reached the router behind the filter (see `body_wait`).
    pub fn reached_router(&mut self) {
        let id = self.counter(REACHED_ROUTER);
        self.bump(id);
    }

    pub fn fanout_started(&mut self) {
        self.in_flight_delta = self.in_flight_delta.saturating_add(1);
    }

    /// Work still owed after its fan-out ended (a dedupe settle queued for etcd or in
    /// flight): counted in `fanout.in_flight` too, `delta` +1 when owed, -1 when done.
    pub fn owed(&mut self, delta: i64) {
        self.in_flight_delta += delta;
    }

    /// A fan-out ended: answered (with its duration), or its client went away.
    pub fn fanout_ended(&mut self, duration_ms: Option<u64>) {
        self.in_flight_delta = self.in_flight_delta.saturating_sub(1);
        if let Some(ms) = duration_ms {
            self.sample(false, ms);
        }
    }

    /// Makes the dedupe counters and gauge exist (at zero) before the first request.
    pub fn register_dedupe(&mut self) {
        self.dedupe = true;
        for name in [
            DEDUPE_MISSING_KEY,
            DEDUPE_SKIPPED,
            DEDUPE_IN_PROGRESS,
            DEDUPE_STORE_ERRORS,
        ] {
            self.counter(name);
        }
    }

    /// Whether [`Tally::register_dedupe`] was called: the entries gauge exists.
    pub fn has_dedupe(&self) -> bool {
        self.dedupe
    }

    /// A request with dedupe on but no usable key: fanned out to everyone.
    pub fn dedupe_missing_key(&mut self) {
        let id = self.counter(DEDUPE_MISSING_KEY);
        self.bump(id);
    }

    /// Subscribers not called: `already` had the event, `in_progress` were being called.
    pub fn dedupe_skipped(&mut self, already: usize, in_progress: usize) {
        for (name, n) in [(DEDUPE_SKIPPED, already), (DEDUPE_IN_PROGRESS, in_progress)] {
            if n > 0 {
                let id = self.counter(name);
                self.add(id, n as u64);
            }
        }
    }

    /// `n` requests met a store error (a claim or a settle given up).
    pub fn dedupe_store_errors(&mut self, n: u64) {
        let id = self.counter(DEDUPE_STORE_ERRORS);
        self.add(id, n);
    }

    /// Events added to (or, negative, removed from) the store by one write.
    pub fn dedupe_entries(&mut self, delta: i64) {
        self.dedupe_entries_delta = self.dedupe_entries_delta.saturating_add(delta);
    }

    /// Makes the counters of a cluster exist (at zero) before its first call; its index.
    pub fn register_subscriber(&mut self, cluster: &str) -> usize {
        let at = self.cluster(cluster);
        self.subscriber(at, |_| None);
        at
    }

    /// Makes the reply counters of a subscriber with a reply target exist (at zero).
    pub fn register_replies(&mut self, cluster: &str) {
        self.replies(cluster);
    }

    /// `cluster` answered 2xx with a body that is not a CloudEvent: not a reply, discarded.
    pub fn reply_discarded(&mut self, cluster: &str) {
        let ids = self.replies(cluster);
        self.bump(ids.discarded);
    }

    /// `cluster`'s reply failed for good (it may still have gone to the dead-letter target).
    pub fn reply_failed(&mut self, cluster: &str, failure: &Failure) {
        let ids = self.replies(cluster);
        if let Some(&id) = ids.failed.get(failure_index(failure)) {
            self.bump(id);
        }
    }

    /// Every counter name known so far.
    pub fn counter_names(&self) -> &[String] {
        &self.names
    }

    /// A retry of the event to the cluster at `at` was sent.
    pub fn retried(&mut self, at: usize) {
        if let Some(id) = self.subscriber(at, |ids| Some(ids.retries)) {
            self.bump(id);
        }
    }

    /// The subscriber of the cluster at `at` failed for good, and its dead-letter target
    /// took the event.
    pub fn dead_lettered(&mut self, at: usize) {
        if let Some(id) = self.subscriber(at, |ids| Some(ids.dead_lettered)) {
            self.bump(id);
        }
    }

    /// A fan-out ended with a subscriber that failed for good after the sender's answer: in
    /// async mode, or a best-effort subscriber.
    pub fn undelivered(&mut self) {
        let id = self.counter(UNDELIVERED);
        self.bump(id);
    }

    /// Makes a capped subscriber's gauges and refusal counter exist (at zero).
    pub fn register_call_cap(&mut self, cluster: &str) {
        let prefix = format!("fanout.subscriber.{}", stat_segment(cluster));
        self.counter(&format!("{prefix}.refused"));
        for gauge in ["calls_in_flight", "calls_queued"] {
            self.gauge(&format!("{prefix}.{gauge}"));
        }
    }

    /// The change of gauge `name` since the last flush, the gauge made if new.
    fn gauge(&mut self, name: &str) -> Option<&mut i64> {
        if let Some(index) = self.gauges.iter().position(|(n, _)| n == name) {
            return self.gauges.get_mut(index).map(|(_, delta)| delta);
        }
        self.gauges.push((name.to_string(), 0));
        self.gauges.last_mut().map(|(_, delta)| delta)
    }

    /// The gauges' names, to define them.
    pub fn gauge_names(&self) -> impl Iterator<Item = &String> {
        self.gauges.iter().map(|(name, _)| name)
    }

    /// A capped subscriber's calls in flight and waiting changed by these amounts.
    pub fn call_gauges(&mut self, cluster: &str, in_flight_delta: i64, queued_delta: i64) {
        let prefix = format!("fanout.subscriber.{}", stat_segment(cluster));
        for (gauge, delta) in [
            ("calls_in_flight", in_flight_delta),
            ("calls_queued", queued_delta),
        ] {
            if delta != 0 {
                if let Some(total) = self.gauge(&format!("{prefix}.{gauge}")) {
                    *total = total.saturating_add(delta);
                }
            }
        }
    }

    /// A request refused because subscriber `cluster`'s line (`max_queued_calls`) was full.
    pub fn refused(&mut self, cluster: &str) {
        let id = self.counter(&format!(
            "fanout.subscriber.{}.refused",
            stat_segment(cluster)
        ));
        self.bump(id);
    }

    /// A call to the cluster at `at` (an index from [`Tally::cluster`]) was made.
    pub fn call_started(&mut self, at: usize) {
        if let Some(id) = self.subscriber(at, |ids| Some(ids.calls)) {
            self.bump(id);
        }
    }

    /// A subscriber's filter did not want the event: no call, no failure.
    pub fn call_skipped(&mut self, at: usize) {
        if let Some(id) = self.subscriber(at, |ids| Some(ids.skipped)) {
            self.bump(id);
        }
    }

    /// A call to the cluster at `at` ended.
    pub fn call_ended(
        &mut self,
        at: usize,
        result: &Result<(), Failure>,
        duration_ms: Option<u64>,
    ) {
        let id = self.subscriber(at, |ids| match result {
            Ok(()) => Some(ids.delivered),
            Err(failure) => ids.failed.get(failure_index(failure)).copied(),
        });
        if let Some(id) = id {
            self.bump(id);
        }
        if let Some(ms) = duration_ms {
            self.sample(true, ms);
        }
    }

    /// A duration sample (`call`: a call's, else a fan-out's), kept while its buffer has
    /// room: bounded even if flushes stop (they should not: the root context flushes on every
    /// tick and whenever [`Tally::wants_flush`]); a sample past it is counted as dropped.
    #[inline]
    fn sample(&mut self, call: bool, ms: u64) {
        let buffer = if call {
            &mut self.call_ms
        } else {
            &mut self.fanout_ms
        };
        if buffer.len() < 4 * HISTOGRAM_BUFFER {
            buffer.push(ms);
        } else {
            self.sample_dropped();
        }
    }

    #[cold]
    #[inline(never)]
    fn sample_dropped(&mut self) {
        let id = self.counter(SAMPLES_DROPPED);
        self.bump(id);
    }

    /// Whether a histogram buffer is full enough that it should be flushed now rather than
    /// at the next tick.
    pub fn wants_flush(&self) -> bool {
        self.fanout_ms.len() >= HISTOGRAM_BUFFER || self.call_ms.len() >= HISTOGRAM_BUFFER
    }

    /// Takes everything counted since the last flush.
    pub fn flush(&mut self) -> Flush {
        // In the order the counters were registered (no sort: its code costs module size per
        // element type, and Envoy does not care in which order stats change).
        let counters: Vec<(usize, u64)> = self
            .counts
            .iter_mut()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(at, n)| (at, std::mem::take(n)))
            .collect();
        Flush {
            counters,
            in_flight_delta: std::mem::take(&mut self.in_flight_delta),
            fanout_ms: std::mem::take(&mut self.fanout_ms),
            call_ms: std::mem::take(&mut self.call_ms),
            dedupe_entries_delta: std::mem::take(&mut self.dedupe_entries_delta),
            gauges: self
                .gauges
                .iter_mut()
                .filter(|(_, delta)| *delta != 0)
                .map(|(name, delta)| (name.clone(), std::mem::take(delta)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flush with its counters by name, sorted (the order they were registered in is not
    /// what is tested).
    struct Named {
        counters: Vec<(String, u64)>,
        in_flight_delta: i64,
        fanout_ms: Vec<u64>,
        call_ms: Vec<u64>,
    }

    fn flushed(tally: &mut Tally) -> Named {
        let flush = tally.flush();
        let mut counters: Vec<(String, u64)> = flush
            .counters
            .iter()
            .map(|&(at, n)| {
                (
                    tally.counter_names().get(at).cloned().unwrap_or_default(),
                    n,
                )
            })
            .collect();
        counters.sort_unstable();
        Named {
            counters,
            in_flight_delta: flush.in_flight_delta,
            fanout_ms: flush.fanout_ms,
            call_ms: flush.call_ms,
        }
    }

    #[test]
    fn stat_segments_are_one_readable_segment() {
        assert_eq!(stat_segment("billing"), "billing");
        assert_eq!(stat_segment("my-cluster_2"), "my-cluster_2");
        assert_eq!(
            stat_segment("outbound|80||billing.default.svc.cluster.local"),
            "outbound_80__billing_default_svc_cluster_local"
        );
        assert_eq!(stat_segment("a b:c"), "a_b_c");
        assert_eq!(stat_segment("ünï"), "_n_");
        assert_eq!(stat_segment(""), "_");
    }

    #[test]
    fn failure_kinds() {
        let status = |s| Failure::Status {
            status: s,
            detail: String::new(),
        };
        assert_eq!(failure_kind(&status(404)), "status_4xx");
        assert_eq!(failure_kind(&status(503)), "status_5xx");
        assert_eq!(failure_kind(&status(302)), "status_other");
        assert_eq!(failure_kind(&Failure::Timeout), "timeout");
        assert_eq!(
            failure_kind(&Failure::Reset {
                detail: String::new()
            }),
            "reset"
        );
        assert_eq!(failure_kind(&Failure::NoResponse), "no_response");
        assert_eq!(
            failure_kind(&Failure::DispatchError {
                detail: String::new()
            }),
            "dispatch_error"
        );
        assert_eq!(
            failure_kind(&Failure::TooLarge { size: 2, limit: 1 }),
            "too_large"
        );
    }

    #[test]
    fn reply_counters_exist_only_for_subscribers_with_replies_and_count_by_kind() {
        let mut tally = Tally::default();
        let plain = tally.register_subscriber("plain");
        assert!(!tally.counter_names().iter().any(|n| n.contains("reply")));
        assert!(!tally
            .counter_names()
            .iter()
            .any(|n| n.ends_with("failed.too_large")));
        tally.register_replies("answering");
        let names = tally.counter_names();
        assert!(names.contains(&"fanout.subscriber.answering.reply_discarded".to_string()));
        for kind in FAILURE_KINDS {
            assert!(
                names.contains(&format!("fanout.subscriber.answering.reply_failed.{kind}")),
                "{kind}"
            );
        }
        tally.reply_discarded("answering");
        tally.reply_discarded("answering");
        tally.reply_failed("answering", &Failure::TooLarge { size: 2, limit: 1 });
        tally.reply_failed("answering", &Failure::Timeout);
        // A call never fails too_large; counting one changes nothing.
        tally.call_ended(plain, &Err(Failure::TooLarge { size: 2, limit: 1 }), None);
        let counters = flushed(&mut tally).counters;
        let expected: Vec<(String, u64)> = [
            ("fanout.subscriber.answering.reply_discarded", 2),
            ("fanout.subscriber.answering.reply_failed.timeout", 1),
            ("fanout.subscriber.answering.reply_failed.too_large", 1),
        ]
        .iter()
        .map(|(n, c)| (n.to_string(), *c))
        .collect();
        assert_eq!(counters, expected);
    }

    #[test]
    fn a_flush_takes_the_counts_since_the_last_one() {
        let mut tally = Tally::default();
        tally.received();
        tally.received();
        tally.fanout_started();
        let (billing, shipping) = (tally.cluster("billing.default"), tally.cluster("shipping"));
        tally.call_started(billing);
        tally.call_started(shipping);
        tally.call_ended(billing, &Ok(()), Some(3));
        tally.call_ended(shipping, &Err(Failure::Timeout), Some(250));
        let audit = tally.cluster("audit");
        tally.call_skipped(audit);
        tally.answered(500);
        tally.fanout_ended(Some(251));
        tally.answered(404);
        let flush = flushed(&mut tally);
        let expected: Vec<(String, u64)> = [
            ("fanout.requests.failed", 1),
            ("fanout.requests.received", 2),
            ("fanout.requests.rejected.404", 1),
            ("fanout.subscriber.audit.skipped", 1),
            ("fanout.subscriber.billing_default.calls", 1),
            ("fanout.subscriber.billing_default.delivered", 1),
            ("fanout.subscriber.shipping.calls", 1),
            ("fanout.subscriber.shipping.failed.timeout", 1),
        ]
        .iter()
        .map(|(n, c)| (n.to_string(), *c))
        .collect();
        assert_eq!(flush.counters, expected);
        assert_eq!(flush.in_flight_delta, 0);
        assert_eq!(flush.fanout_ms, vec![251]);
        assert_eq!(flush.call_ms, vec![3, 250]);

        assert_eq!(tally.flush(), Flush::default());
        tally.fanout_started();
        tally.received();
        let flush = flushed(&mut tally);
        assert_eq!(flush.in_flight_delta, 1);
        assert_eq!(
            flush.counters,
            vec![("fanout.requests.received".to_string(), 1)]
        );
    }

    #[test]
    fn histogram_buffers_ask_for_a_flush_and_stay_bounded() {
        let mut tally = Tally::default();
        for i in 0..HISTOGRAM_BUFFER as u64 - 1 {
            tally.fanout_ended(Some(i));
        }
        assert!(!tally.wants_flush());
        tally.fanout_ended(Some(1));
        assert!(tally.wants_flush());
        for _ in 0..10 * HISTOGRAM_BUFFER {
            tally.fanout_ended(Some(1));
        }
        let flush = flushed(&mut tally);
        assert_eq!(flush.fanout_ms.len(), 4 * HISTOGRAM_BUFFER);
        let dropped = 11 * HISTOGRAM_BUFFER as u64 - 4 * HISTOGRAM_BUFFER as u64;
        assert_eq!(
            flush.counters,
            vec![("fanout.metrics.samples_dropped".to_string(), dropped)]
        );
    }
}
