//! Hands the counts of [`crate::metrics::Tally`] to Envoy's stats: defines each metric once,
//! then on every root-context tick adds what was counted since the last one.

use hashbrown::HashMap;
use std::cell::RefCell;
use std::rc::Rc;

use crate::cell::with_mut;
use crate::host::Host;
use crate::metrics::{self, Kind, Tally};

#[derive(Default)]
pub struct Telemetry {
    pub tally: Tally,
    /// Envoy metric ids by name.
    ids: HashMap<String, u32>,
    /// The counters' ids by their index in the tally, once looked up (a flush names no
    /// counter: no name copied or hashed per count handed over).
    counter_ids: Vec<Option<u32>>,
}

impl Telemetry {
    fn id<H: Host>(&mut self, host: &H, kind: Kind, name: &str) -> Option<u32> {
        define(&mut self.ids, host, kind, name)
    }

    /// The id of the tally's counter at `at`.
    fn counter_id<H: Host>(&mut self, host: &H, at: usize) -> Option<u32> {
        if let Some(&Some(id)) = self.counter_ids.get(at) {
            return Some(id);
        }
        let name = self.tally.counter_names().get(at)?;
        let id = define(&mut self.ids, host, Kind::Counter, name)?;
        if self.counter_ids.len() <= at {
            self.counter_ids.resize(at + 1, None);
        }
        if let Some(slot) = self.counter_ids.get_mut(at) {
            *slot = Some(id);
        }
        Some(id)
    }

    /// Defines every metric known so far, so that they show (at zero) before anything
    /// happens.
    pub fn define_all<H: Host>(&mut self, host: &H) {
        let names: Vec<String> = self.tally.counter_names().to_vec();
        for name in names {
            self.id(host, Kind::Counter, &name);
        }
        self.id(host, Kind::Gauge, metrics::IN_FLIGHT);
        self.id(host, Kind::Histogram, metrics::FANOUT_DURATION);
        self.id(host, Kind::Histogram, metrics::CALL_DURATION);
        if self.tally.has_dedupe() {
            self.id(host, Kind::Gauge, metrics::DEDUPE_ENTRIES);
        }
        let gauges: Vec<String> = self.tally.gauge_names().cloned().collect();
        for name in gauges {
            self.id(host, Kind::Gauge, &name);
        }
    }

    /// Adds what was counted since the last flush to Envoy's stats.
    pub fn flush<H: Host>(&mut self, host: &H) {
        let flush = self.tally.flush();
        for (at, n) in flush.counters {
            if let Some(id) = self.counter_id(host, at) {
                host.increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        if flush.in_flight_delta != 0 {
            if let Some(id) = self.id(host, Kind::Gauge, metrics::IN_FLIGHT) {
                host.increment_metric(id, flush.in_flight_delta);
            }
        }
        if flush.dedupe_entries_delta != 0 {
            if let Some(id) = self.id(host, Kind::Gauge, metrics::DEDUPE_ENTRIES) {
                host.increment_metric(id, flush.dedupe_entries_delta);
            }
        }
        for (name, delta) in flush.gauges {
            if let Some(id) = self.id(host, Kind::Gauge, &name) {
                host.increment_metric(id, delta);
            }
        }
        for (name, samples) in [
            (metrics::FANOUT_DURATION, flush.fanout_ms),
            (metrics::CALL_DURATION, flush.call_ms),
        ] {
            if samples.is_empty() {
                continue;
            }
            if let Some(id) = self.id(host, Kind::Histogram, name) {
                for value in samples {
                    host.record_metric(id, value);
                }
            }
        }
    }
}

/// The id of the metric `name`, defined with the host on first use.
fn define<H: Host>(
    ids: &mut HashMap<String, u32>,
    host: &H,
    kind: Kind,
    name: &str,
) -> Option<u32> {
    if let Some(&id) = ids.get(name) {
        return Some(id);
    }
    let id = host.define_metric(kind, name)?;
    ids.insert(name.to_string(), id);
    Some(id)
}

/// How a stream counts: into its worker's [`Telemetry`], or not at all when the configuration
/// turns metrics off.
#[derive(Clone, Default)]
pub struct Counter(Option<Rc<RefCell<Telemetry>>>);

impl Counter {
    pub fn new(telemetry: Option<Rc<RefCell<Telemetry>>>) -> Self {
        Counter(telemetry)
    }

    /// Counts something, and flushes at once if a histogram buffer is full.
    pub fn count<H: Host>(&self, host: &H, record: impl FnOnce(&mut Tally)) {
        if let Some(telemetry) = &self.0 {
            count_into(telemetry, host, record);
        }
    }
}

/// The one way to count: `record` into `telemetry`'s tally (lost rather than a
/// panic if the cell is busy: see [`with_mut`]), flushed at once if a
/// histogram buffer is full. [`Counter::count`] for a stream; the deliveries call it with
/// their worker's telemetry when the configuration counts.
pub fn count_into<H: Host>(
    telemetry: &RefCell<Telemetry>,
    host: &H,
    record: impl FnOnce(&mut Tally),
) {
    with_mut(telemetry, |telemetry| {
        record(&mut telemetry.tally);
        if telemetry.tally.wants_flush() {
            flush_now(telemetry, host);
        }
    });
}

/// Out of line: the rare path of every count site.
#[inline(never)]
fn flush_now<H: Host>(telemetry: &mut Telemetry, host: &H) {
    telemetry.flush(host);
}
