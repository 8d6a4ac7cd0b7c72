//! Who gets this event: the one place that decides it, once the request is complete. In this
//! order: each subscriber's filter (a subscriber that does not want the event is skipped,
//! never called, and counted); in async mode the `max_in_flight` cap (a 503, before anything
//! is claimed, so that a refused request leaves no claim behind); then `dedupe` (subscribers
//! that already have the event, or that another request is delivering it to right now, are
//! not called; the others are claimed for this request).
//!
//! It decides and returns; the caller acts: [`choose`] runs the filters and says what the
//! event needs room for ([`Room`], which the worker's pipeline checks); then
//! [`Chosen::claim`] makes the claims. What comes out is a [`FanOut`] whose ready calls are
//! exactly the subscribers to call, and the claims to settle when it ends.
//!
//! The claims are `dedupe::claim`'s.

use crate::config::{AnswerMode, Channel, Config, ReportDetail};
use crate::dedupe::claim::{self, Claim};
use crate::fan_out_state::FanOut;
use crate::host::Host;
use crate::request::Event;
use crate::telemetry::Counter;

/// The event to deliver, as far as choosing its recipients needs it.
pub struct Incoming<'a> {
    /// Its context id, for log lines.
    pub log_id: u32,
    /// When its headers came, on the host's clock.
    pub started_ms: u64,
    pub channel: &'a Channel,
    pub event: &'a Event,
}

/// Who gets the event, before anything is claimed: the fan-out with the skipped
/// subscribers ended, and what the worker must have room for ([`Room`]). Then
/// [`Chosen::claim`].
pub struct Chosen<'a> {
    fanout: FanOut,
    /// The subscribers the event is for (by index in the channel), to claim.
    wanted: Vec<usize>,
    pub room: Room<'a>,
}

/// What must fit before anything is claimed (a refused request must leave no claim
/// behind): the caller asks the worker's pipeline (`Pipeline::admit`).
pub struct Room<'a> {
    /// `max_in_flight` bounds the event (async mode, or a channel of best-effort subscribers).
    pub in_flight: bool,
    /// `max_concurrent_calls`: the clusters of its first calls, when any cluster is capped.
    pub clusters: Option<Vec<&'a str>>,
}

/// Who gets the event.
pub struct Recipients {
    /// One call per subscriber: ready for those who get the event, ended for the others.
    pub fanout: FanOut,
    /// `dedupe`'s claims, for its store to make in the pipeline's claim stage (`None`:
    /// nothing to claim).
    pub claim: Option<Claim>,
}

/// Decides who gets the event of `request` by the subscribers' filters (a skip is counted),
/// and what it needs room for.
pub fn choose<'a, H: Host>(
    host: &H,
    counter: &Counter,
    config: &Config,
    request: &Incoming<'a>,
) -> Chosen<'a> {
    let channel = request.channel;
    let mut fanout = FanOut::new(channel.subscribers.len(), request.started_ms)
        .with_full_report(config.report == ReportDetail::Full)
        .with_only_required(channel.subscribers.iter().all(|s| s.required));
    let mut wanted = Vec::with_capacity(channel.subscribers.len());
    for (index, subscriber) in channel.subscribers.iter().enumerate() {
        if subscriber.accepts(request.event.attributes.as_ref()) {
            wanted.push(index);
        } else {
            fanout.skip(index);
            counter.count(host, |tally| tally.call_skipped(subscriber.stats.event));
        }
    }
    let clusters = (!config.call_caps.is_empty()).then(|| {
        wanted
            .iter()
            .filter_map(|&index| channel.subscribers.get(index))
            .map(|sub| sub.cluster.as_str())
            .collect()
    });
    let room = Room {
        in_flight: config.mode == AnswerMode::Async || channel.all_best_effort(),
        clusters,
    };
    Chosen {
        fanout,
        wanted,
        room,
    }
}

impl Chosen<'_> {
    /// The event fits: what `dedupe` must claim of the subscribers it is for, for the
    /// pipeline's claim stage (`None` with `dedupe` off).
    pub fn claim<H: Host>(
        self,
        host: &H,
        counter: &Counter,
        config: &Config,
        request: &Incoming<'_>,
    ) -> Recipients {
        let Chosen { fanout, wanted, .. } = self;
        let asking = claim::Asking {
            log_id: request.log_id,
            started_ms: request.started_ms,
            channel: request.channel,
            key: request.event.key.as_deref(),
        };
        let dedupe = config.dedupe.as_ref();
        let claim = dedupe.and_then(|d| claim::claim(host, counter, d, &asking, &wanted));
        Recipients { fanout, claim }
    }
}
