//! Call slots: at most `max_concurrent_calls` calls in flight to one subscriber cluster on one
//! worker, the calls beyond it waiting in line (first in, first out), and the admission of a
//! new event, refused when one of its first calls would wait beyond `max_queued_calls`.
//!
//! Plain bookkeeping with no clock and no proxy-wasm. The orchestration names the calls with
//! ids of its own choosing (a job and a subscriber index, say) and the clusters with keys of
//! its own choosing (the cluster name), and then:
//! - before it takes a new event, asks [`CallSlots::check`] whether the event's first calls
//!   fit; a [`Refusal`] names the subscriber that has no room, and its [`Refusal::answer`] is
//!   the 503 for the sender. Nothing is reserved by a refusal: nobody is called.
//! - for every call it is about to make (an event's first call, a retry, a reply, a dead
//!   letter), asks [`CallSlots::start`]: [`Start::Now`] with a [`Slot`] to send it at once, or
//!   [`Start::Queued`]. `start` never refuses: the calls of an event already admitted always
//!   go out in the end, even beyond `max_queued_calls`.
//! - when a call ends (answered, timed out, refused at dispatch, or forgotten because Envoy
//!   will never answer it), hands its slot back to [`CallSlots::end`], which returns the next
//!   waiting call of that cluster, if any, holding the freed slot.
//! - when an event is abandoned, takes its waiting calls out with [`CallSlots::cancel`]
//!   *before* it ends its calls in flight, so that none of its own waiting calls takes a
//!   freed slot.
//!
//! The line holds ids only, no deadlines: a waiting call's timeout starts when it is sent.
//!
//! Keys are kept for the life of the value, also when a new configuration takes a cluster's
//! cap away ([`CallSlots::set_caps`]): calls still in flight under the old configuration keep
//! counting, so a cap that comes back is exact at once. Every key ever started or capped
//! costs one small entry.
//!
//! What it deliberately is not: a rate limiter (calls per second), nor a cap for the whole
//! Envoy: each worker runs its own VM with its own slots, so `--concurrency 4` allows four
//! times `max_concurrent_calls`. Envoy's circuit breakers on the cluster (`max_requests`,
//! `max_pending_requests`) are another, process-wide limit that the cluster has besides.

use std::collections::VecDeque;
use std::fmt::Display;
use std::hash::Hash;

use hashbrown::{Equivalent, HashMap};
use serde::Serialize;

use crate::answer::Answer;

/// `max_queued_calls` when a cap is set and the queue limit is not.
pub const DEFAULT_MAX_QUEUED_CALLS: u32 = 1000;
/// The `retry-after` (seconds) of a refusal: a queue drains at the pace of the subscriber's
/// answers, so a short wait is the honest suggestion.
pub const REFUSAL_RETRY_AFTER_SECS: u32 = 1;
/// At most one warning per cluster this often about refused requests; the next one says how
/// many refusals went unlogged in between.
pub const REFUSAL_WARNING_INTERVAL_MS: u64 = 10_000;

/// The limits of one cluster, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallCap {
    /// Calls in flight at once on one worker; at least 1 (the configuration refuses 0).
    pub max_concurrent_calls: u32,
    /// Calls waiting for a slot beyond which a new event is refused. 0: never wait, refuse
    /// an event as soon as every slot is taken.
    pub max_queued_calls: u32,
}

/// A slot a call holds while it is in flight. Hand it back to [`CallSlots::end`] exactly once
/// when the call ends, or the cluster loses a slot for the life of the worker.
#[must_use = "a slot not handed back to CallSlots::end is lost for the life of the worker"]
#[derive(Debug, PartialEq, Eq)]
pub struct Slot {
    lane: usize,
}

impl Slot {
    /// A call that no lane counts: [`CallSlots::end`] ignores it.
    pub fn uncounted() -> Slot {
        Slot { lane: usize::MAX }
    }
}

/// What to do with a call.
#[must_use]
#[derive(Debug, PartialEq, Eq)]
pub enum Start {
    /// Send it now; it holds this slot.
    Now(Slot),
    /// It waits in line; [`CallSlots::end`] or [`CallSlots::set_caps`] hands it out later.
    Queued,
}

/// A new event that does not fit: one of its first calls would wait beyond
/// `max_queued_calls` of its cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal<K> {
    /// The cluster (the subscriber) that has no room.
    pub key: K,
    pub in_flight: u32,
    pub queued: usize,
    pub cap: CallCap,
    /// How many of the event's first calls would have waited there.
    pub would_queue: u32,
}

/// A cluster's gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gauges<'a, K> {
    pub key: &'a K,
    pub in_flight: u32,
    pub queued: usize,
}

#[derive(Debug)]
struct Lane<K, C> {
    key: K,
    cap: Option<CallCap>,
    in_flight: u32,
    waiting: VecDeque<C>,
    /// When the last refusal warning was logged, and refusals since.
    last_warning_ms: Option<u64>,
    unlogged_refusals: u64,
}

impl<K, C> Lane<K, C> {
    fn new(key: K, cap: Option<CallCap>) -> Self {
        Lane {
            key,
            cap,
            in_flight: 0,
            waiting: VecDeque::new(),
            last_warning_ms: None,
            unlogged_refusals: 0,
        }
    }

    fn has_room(&self) -> bool {
        self.cap
            .is_none_or(|cap| self.in_flight < cap.max_concurrent_calls)
    }

    /// The next waiting call, if a slot is free: it takes the slot.
    fn release_one(&mut self, lane: usize) -> Option<(C, Slot)> {
        if !self.has_room() {
            return None;
        }
        let call = self.waiting.pop_front()?;
        self.in_flight = self.in_flight.saturating_add(1);
        Some((call, Slot { lane }))
    }
}

/// Every cluster's calls in flight and waiting, on one worker.
#[derive(Debug)]
pub struct CallSlots<K, C> {
    /// Never shrinks: a [`Slot`] is an index into it.
    lanes: Vec<Lane<K, C>>,
    by_key: HashMap<K, usize>,
}

impl<K, C> Default for CallSlots<K, C> {
    fn default() -> Self {
        CallSlots {
            lanes: Vec::new(),
            by_key: HashMap::new(),
        }
    }
}

impl<K: Clone + Eq + Hash, C> CallSlots<K, C> {
    #[cfg(test)]
    pub fn new() -> Self {
        CallSlots::default()
    }

    /// The caps of a (new) configuration: the clusters listed get theirs, every other one has
    /// none from now on. Calls that now have room go out: they are returned, each with its
    /// slot, in the order they waited per cluster.
    pub fn set_caps(&mut self, caps: impl IntoIterator<Item = (K, CallCap)>) -> Vec<(C, Slot)> {
        for lane in &mut self.lanes {
            lane.cap = None;
        }
        for (key, cap) in caps {
            let lane = self.lane_for(&key);
            if let Some(lane) = self.lanes.get_mut(lane) {
                lane.cap = Some(cap);
            }
        }
        let mut released = Vec::new();
        for (index, lane) in self.lanes.iter_mut().enumerate() {
            while let Some(next) = lane.release_one(index) {
                released.push(next);
            }
        }
        released
    }

    /// Whether a new event whose first calls go to `first_calls` (one key per call, in the
    /// order of its subscribers; a cluster may appear more than once) fits: for every capped
    /// cluster, the calls that would have to wait, added to those already waiting, stay
    /// within `max_queued_calls`. Otherwise the refusal of the first subscriber, in that
    /// order, that has no room. Reserves nothing.
    pub fn check<'k, Q>(
        &self,
        first_calls: impl IntoIterator<Item = &'k Q>,
    ) -> Result<(), Refusal<K>>
    where
        Q: Hash + Equivalent<K> + ?Sized + 'k,
    {
        if !self.has_caps() {
            return Ok(());
        }
        // By lane: how many of the event's first calls go to it, and the position of the
        // first of them (usize::MAX: none). Counted in place, no sort on the request path.
        let mut wanted: Vec<(u32, usize)> = Vec::new();
        for (position, key) in first_calls.into_iter().enumerate() {
            let Some(&lane) = self.by_key.get(key) else {
                continue;
            };
            if self.lanes.get(lane).is_none_or(|lane| lane.cap.is_none()) {
                continue;
            }
            if wanted.len() <= lane {
                wanted.resize(lane + 1, (0, usize::MAX));
            }
            if let Some((calls, first)) = wanted.get_mut(lane) {
                *calls = calls.saturating_add(1);
                *first = (*first).min(position);
            }
        }
        let mut refused: Option<(usize, Refusal<K>)> = None;
        for (lane_index, &(wanted, first_position)) in wanted.iter().enumerate() {
            if refused.as_ref().is_some_and(|(p, _)| *p <= first_position) {
                continue;
            }
            if let Some(refusal) = self.refusal(lane_index, wanted) {
                refused = Some((first_position, refusal));
            }
        }
        match refused {
            Some((_, refusal)) => Err(refusal),
            None => Ok(()),
        }
    }

    /// The refusal of `wanted` more calls in the lane `lane_index`, when those that would
    /// have to wait do not fit in its line; `None` when they fit or it has no cap.
    fn refusal(&self, lane_index: usize, wanted: u32) -> Option<Refusal<K>> {
        let lane = self.lanes.get(lane_index)?;
        let cap = lane.cap?;
        let free = cap.max_concurrent_calls.saturating_sub(lane.in_flight);
        let would_queue = wanted.saturating_sub(free);
        let after = lane.waiting.len().saturating_add(would_queue as usize);
        if would_queue == 0 || after <= cap.max_queued_calls as usize {
            return None;
        }
        Some(Refusal {
            key: lane.key.clone(),
            in_flight: lane.in_flight,
            queued: lane.waiting.len(),
            cap,
            would_queue,
        })
    }

    /// A call to `key` is to be made: now, with a slot, or later, in line behind the calls
    /// already waiting for that cluster. Never refused.
    pub fn start(&mut self, key: &K, call: C) -> Start {
        let index = self.lane_for(key);
        let Some(lane) = self.lanes.get_mut(index) else {
            // Not reachable (lane_for always gives a lane); an uncounted call is the safe side.
            return Start::Now(Slot::uncounted());
        };
        if lane.waiting.is_empty() && lane.has_room() {
            lane.in_flight = lane.in_flight.saturating_add(1);
            Start::Now(Slot { lane: index })
        } else {
            lane.waiting.push_back(call);
            Start::Queued
        }
    }

    /// A call ended: its slot is free. The next call waiting for that cluster, if there is
    /// room (a new configuration may have lowered the cap), now holds the slot: send it.
    /// No cluster was ever capped nor a call counted: calls need no slot.
    pub fn is_unused(&self) -> bool {
        self.lanes.is_empty()
    }

    /// Whether any cluster has a cap now: without one, every event fits.
    pub fn has_caps(&self) -> bool {
        self.lanes.iter().any(|lane| lane.cap.is_some())
    }

    pub fn end(&mut self, slot: Slot) -> Option<(C, Slot)> {
        let lane = self.lanes.get_mut(slot.lane)?;
        lane.in_flight = lane.in_flight.saturating_sub(1);
        lane.release_one(slot.lane)
    }

    /// Takes every waiting call for which `abandoned` is true out of line (those of an event
    /// that is given up); returns them. Calls in flight are not touched: end them after this.
    pub fn cancel(&mut self, mut abandoned: impl FnMut(&C) -> bool) -> Vec<C> {
        let mut cancelled = Vec::new();
        for lane in &mut self.lanes {
            if lane.waiting.iter().any(&mut abandoned) {
                let (gone, kept): (VecDeque<C>, VecDeque<C>) =
                    lane.waiting.drain(..).partition(|call| abandoned(call));
                lane.waiting = kept;
                cancelled.extend(gone);
            }
        }
        cancelled
    }

    /// The cap of `key` in the current configuration.
    pub fn cap(&self, key: &K) -> Option<CallCap> {
        self.lane(key).and_then(|lane| lane.cap)
    }

    /// Calls to `key` in flight (holding a slot).
    #[cfg(test)]
    pub fn in_flight(&self, key: &K) -> u32 {
        self.lane(key).map_or(0, |lane| lane.in_flight)
    }

    /// Calls to `key` waiting for a slot.
    #[cfg(test)]
    pub fn queued(&self, key: &K) -> usize {
        self.lane(key).map_or(0, |lane| lane.waiting.len())
    }

    /// Every cluster's gauges, for the metrics.
    pub fn gauges(&self) -> impl Iterator<Item = Gauges<'_, K>> {
        self.lanes.iter().map(|lane| Gauges {
            key: &lane.key,
            in_flight: lane.in_flight,
            queued: lane.waiting.len(),
        })
    }

    /// Counts a refusal of `key` at `now_ms` (any clock) and says whether to log a warning
    /// about it: `Some(n)` with the number of earlier refusals that went unlogged, at most
    /// once per [`REFUSAL_WARNING_INTERVAL_MS`] per cluster.
    pub fn note_refusal(&mut self, key: &K, now_ms: u64) -> Option<u64> {
        let index = self.lane_for(key);
        let lane = self.lanes.get_mut(index)?;
        let due = lane.last_warning_ms.is_none_or(|last| {
            now_ms.saturating_sub(last) >= REFUSAL_WARNING_INTERVAL_MS || now_ms < last
        });
        if due {
            lane.last_warning_ms = Some(now_ms);
            Some(std::mem::take(&mut lane.unlogged_refusals))
        } else {
            lane.unlogged_refusals = lane.unlogged_refusals.saturating_add(1);
            None
        }
    }

    fn lane(&self, key: &K) -> Option<&Lane<K, C>> {
        self.by_key
            .get(key)
            .and_then(|&index| self.lanes.get(index))
    }

    /// The lane of `key`, made (with no cap) if it is new.
    fn lane_for(&mut self, key: &K) -> usize {
        if let Some(&index) = self.by_key.get(key) {
            return index;
        }
        let index = self.lanes.len();
        self.lanes.push(Lane::new(key.clone(), None));
        self.by_key.insert(key.clone(), index);
        index
    }
}

/// The body of a refusal's 503.
#[derive(Serialize)]
struct RefusalReport<'a> {
    error: &'a str,
    subscriber: String,
    in_flight: u32,
    queued: usize,
    max_concurrent_calls: u32,
    max_queued_calls: u32,
}

impl<K: Display> Refusal<K> {
    /// What the sender and the log are told.
    pub fn message(&self) -> String {
        format!(
            "subscriber {} has {} call(s) in flight (max_concurrent_calls {}) and {} waiting \
             (max_queued_calls {}) on this worker; the event was not sent to any subscriber; \
             try again later",
            self.key,
            self.in_flight,
            self.cap.max_concurrent_calls,
            self.queued,
            self.cap.max_queued_calls
        )
    }

    /// The sender's answer: 503 with `retry-after` and a JSON error naming the subscriber.
    pub fn answer(&self) -> Answer {
        let message = self.message();
        Answer::json(
            503,
            &RefusalReport {
                error: &message,
                subscriber: self.key.to_string(),
                in_flight: self.in_flight,
                queued: self.queued,
                max_concurrent_calls: self.cap.max_concurrent_calls,
                max_queued_calls: self.cap.max_queued_calls,
            },
        )
        .with_header("retry-after", REFUSAL_RETRY_AFTER_SECS.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(max_concurrent_calls: u32, max_queued_calls: u32) -> CallCap {
        CallCap {
            max_concurrent_calls,
            max_queued_calls,
        }
    }

    /// One step of a scenario, with what it must give.
    enum Step {
        /// `set_caps` with these caps; these calls are released, in this order.
        Caps(&'static [(&'static str, u32, u32)], &'static [u32]),
        /// `check` of an event with these first calls: admitted, or refused naming that key
        /// with that many waiting calls.
        Admits(&'static [&'static str]),
        Refuses(&'static [&'static str], &'static str, u32),
        /// `start` of call `id` to a key: sent now, or queued.
        Now(&'static str, u32),
        Queued(&'static str, u32),
        /// `end` of call `id`; then this call (or none) goes out.
        End(u32, Option<u32>),
        /// `cancel` of the calls with these ids; these are the ones it took out of line.
        Cancel(&'static [u32], &'static [u32]),
        /// The gauges of a key: in flight, waiting.
        Gauges(&'static str, u32, usize),
    }
    use Step::*;

    /// Runs a scenario, keeping each sent call's slot by its id.
    fn run(name: &str, steps: &[Step]) {
        let mut slots: CallSlots<&'static str, u32> = CallSlots::new();
        let mut held: HashMap<u32, Slot> = HashMap::new();
        for (n, step) in steps.iter().enumerate() {
            let at = format!("{name}, step {n}");
            match step {
                Caps(caps, released) => {
                    let got = slots.set_caps(caps.iter().map(|(k, c, q)| (*k, cap(*c, *q))));
                    let ids: Vec<u32> = got.iter().map(|(id, _)| *id).collect();
                    assert_eq!(ids, *released, "{at}: released");
                    held.extend(got);
                }
                Admits(keys) => {
                    assert_eq!(slots.check(keys.iter()), Ok(()), "{at}");
                }
                Refuses(keys, key, would_queue) => {
                    let refusal = slots.check(keys.iter()).expect_err(&at);
                    assert_eq!(
                        (refusal.key, refusal.would_queue),
                        (*key, *would_queue),
                        "{at}: {refusal:?}"
                    );
                    assert_eq!(refusal.in_flight, slots.in_flight(key), "{at}");
                    assert_eq!(refusal.queued, slots.queued(key), "{at}");
                }
                Now(key, id) => match slots.start(key, *id) {
                    Start::Now(slot) => {
                        held.insert(*id, slot);
                    }
                    Start::Queued => panic!("{at}: call {id} to {key} was queued"),
                },
                Queued(key, id) => {
                    assert_eq!(slots.start(key, *id), Start::Queued, "{at}: call {id}");
                }
                End(id, next) => {
                    let slot = held
                        .remove(id)
                        .unwrap_or_else(|| panic!("{at}: {id} not sent"));
                    let released = slots.end(slot);
                    assert_eq!(released.as_ref().map(|(id, _)| *id), *next, "{at}");
                    held.extend(released);
                }
                Cancel(ids, taken) => {
                    let got = slots.cancel(|call| ids.contains(call));
                    assert_eq!(got, *taken, "{at}");
                }
                Gauges(key, in_flight, queued) => {
                    assert_eq!(
                        (slots.in_flight(key), slots.queued(key)),
                        (*in_flight, *queued),
                        "{at}: {key} in flight, queued"
                    );
                }
            }
        }
    }

    #[test]
    fn scenarios() {
        let scenarios: &[(&str, &[Step])] = &[
            (
                "no cap: nothing waits, every event is admitted, calls are counted",
                &[
                    Admits(&["a", "a", "a"]),
                    Now("a", 1),
                    Now("a", 2),
                    Now("a", 3),
                    Gauges("a", 3, 0),
                    Admits(&["a"]),
                    End(2, None),
                    Gauges("a", 2, 0),
                ],
            ),
            (
                "a cap of 2: the third call waits and goes out when one ends",
                &[
                    Caps(&[("a", 2, 10)], &[]),
                    Now("a", 1),
                    Now("a", 2),
                    Queued("a", 3),
                    Gauges("a", 2, 1),
                    End(1, Some(3)),
                    Gauges("a", 2, 0),
                    End(2, None),
                    End(3, None),
                    Gauges("a", 0, 0),
                ],
            ),
            (
                "first in, first out",
                &[
                    Caps(&[("a", 1, 10)], &[]),
                    Now("a", 1),
                    Queued("a", 2),
                    Queued("a", 3),
                    Queued("a", 4),
                    End(1, Some(2)),
                    End(2, Some(3)),
                    Queued("a", 5),
                    End(3, Some(4)),
                    End(4, Some(5)),
                    End(5, None),
                ],
            ),
            (
                "a call that ends hands its slot to the first in line, not to a new call",
                &[
                    Caps(&[("a", 1, 10)], &[]),
                    Now("a", 1),
                    Queued("a", 2),
                    // 1 ends and hands its slot to 2: nothing is free for 3.
                    End(1, Some(2)),
                    Queued("a", 3),
                    End(2, Some(3)),
                ],
            ),
            (
                "an event that would wait beyond max_queued_calls is refused, one that fits is not",
                &[
                    Caps(&[("a", 2, 1)], &[]),
                    Admits(&["a", "a", "a"]),
                    Refuses(&["a", "a", "a", "a"], "a", 2),
                    Now("a", 1),
                    Now("a", 2),
                    Admits(&["a"]),
                    Queued("a", 3),
                    Refuses(&["a"], "a", 1),
                    End(1, Some(3)),
                    Admits(&["a"]),
                ],
            ),
            (
                "retries and replies are never refused: they wait beyond max_queued_calls",
                &[
                    Caps(&[("a", 1, 1)], &[]),
                    Now("a", 1),
                    Queued("a", 2),
                    Queued("a", 3),
                    Queued("a", 4),
                    Gauges("a", 1, 3),
                    Refuses(&["a"], "a", 1),
                ],
            ),
            (
                "max_queued_calls 0: refused as soon as every slot is taken",
                &[
                    Caps(&[("a", 2, 0)], &[]),
                    Admits(&["a", "a"]),
                    Refuses(&["a", "a", "a"], "a", 1),
                    Now("a", 1),
                    Admits(&["a"]),
                    Now("a", 2),
                    Refuses(&["a"], "a", 1),
                    End(2, None),
                    Admits(&["a"]),
                ],
            ),
            (
                "the refusal names the first subscriber, in the event's order, that has no room",
                &[
                    Caps(&[("a", 1, 0), ("b", 1, 0), ("c", 1, 0)], &[]),
                    Now("a", 1),
                    Now("c", 2),
                    Refuses(&["b", "c", "a"], "c", 1),
                    Refuses(&["a", "b", "c"], "a", 1),
                    // A later call to a cluster counts where that cluster first appears.
                    Refuses(&["b", "b", "c"], "b", 1),
                    Admits(&["b"]),
                ],
            ),
            (
                "clusters without a cap, and clusters never seen, admit everything",
                &[
                    Caps(&[("a", 1, 0)], &[]),
                    Now("b", 1),
                    Now("b", 2),
                    Admits(&["b", "b", "unknown", "a"]),
                    Now("a", 3),
                    Refuses(&["b", "unknown", "a"], "a", 1),
                ],
            ),
            (
                "cancelling an abandoned event's waiting calls keeps the others in order",
                &[
                    Caps(&[("a", 1, 10), ("b", 1, 10)], &[]),
                    Now("a", 1),
                    Queued("a", 2),
                    Queued("a", 3),
                    Queued("a", 4),
                    Now("b", 5),
                    Queued("b", 6),
                    Cancel(&[3, 6, 99], &[3, 6]),
                    Gauges("a", 1, 2),
                    Gauges("b", 1, 0),
                    End(1, Some(2)),
                    End(2, Some(4)),
                    End(5, None),
                    Cancel(&[], &[]),
                ],
            ),
            (
                "a raised cap lets waiting calls out at once, in order",
                &[
                    Caps(&[("a", 1, 10)], &[]),
                    Now("a", 1),
                    Queued("a", 2),
                    Queued("a", 3),
                    Queued("a", 4),
                    Caps(&[("a", 3, 10)], &[2, 3]),
                    Gauges("a", 3, 1),
                    End(1, Some(4)),
                ],
            ),
            (
                "a lowered cap lets nothing out until the calls in flight are below it",
                &[
                    Caps(&[("a", 3, 10)], &[]),
                    Now("a", 1),
                    Now("a", 2),
                    Now("a", 3),
                    Queued("a", 4),
                    Caps(&[("a", 1, 10)], &[]),
                    End(1, None),
                    End(2, None),
                    Gauges("a", 1, 1),
                    End(3, Some(4)),
                ],
            ),
            (
                "a cap taken away lets every waiting call out; calls in flight still count",
                &[
                    Caps(&[("a", 1, 10)], &[]),
                    Now("a", 1),
                    Queued("a", 2),
                    Queued("a", 3),
                    Caps(&[], &[2, 3]),
                    Gauges("a", 3, 0),
                    Now("a", 4),
                    End(1, None),
                    // The cap comes back: the three calls still in flight fill it.
                    Caps(&[("a", 3, 10)], &[]),
                    Queued("a", 5),
                    End(2, Some(5)),
                ],
            ),
            (
                "several calls of one event to one cluster: each counts",
                &[
                    Caps(&[("a", 2, 1)], &[]),
                    Admits(&["a", "a", "a"]),
                    Now("a", 1),
                    Refuses(&["a", "a", "a"], "a", 2),
                    Admits(&["a", "a"]),
                ],
            ),
        ];
        for (name, steps) in scenarios {
            run(name, steps);
        }
    }

    #[test]
    fn a_slot_handed_back_twice_cannot_be_forged_and_an_unknown_one_is_ignored() {
        let mut slots: CallSlots<&str, u32> = CallSlots::new();
        let _ = slots.set_caps([("a", cap(1, 1))]);
        assert_eq!(slots.end(Slot { lane: 7 }), None);
        let Start::Now(slot) = slots.start(&"a", 1) else {
            panic!("queued");
        };
        assert_eq!(slots.end(slot), None);
        // A forged second end of the same lane does not go below zero.
        assert_eq!(slots.end(Slot { lane: 0 }), None);
        assert_eq!(slots.in_flight(&"a"), 0);
    }

    /// `check` against a model: the refusal is that of the first call, in the event's order,
    /// whose cluster's line would grow beyond `max_queued_calls`; clusters without a cap
    /// never refuse.
    #[test]
    fn check_refuses_the_first_subscriber_without_room_as_the_model_says() {
        const KEYS: [&str; 4] = ["a", "b", "c", "d"];
        for seed in 0..500u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut slots: CallSlots<&str, u32> = CallSlots::new();
            let mut caps: Vec<(&str, CallCap)> = Vec::new();
            for k in KEYS {
                if rng.bool() {
                    caps.push((k, cap(rng.u32(1..3), rng.u32(0..3))));
                }
            }
            let _ = slots.set_caps(caps.clone());
            let mut held = Vec::new();
            for id in 0..rng.u32(0..8) {
                if let Start::Now(slot) = slots.start(&KEYS[rng.usize(..KEYS.len())], id) {
                    held.push(slot);
                }
            }
            let event: Vec<&str> = (0..rng.usize(0..7))
                .map(|_| KEYS[rng.usize(..KEYS.len())])
                .collect();
            let no_room = |key: &&str| {
                let Some((_, cap)) = caps.iter().find(|(k, _)| k == key) else {
                    return false;
                };
                let wanted = event.iter().filter(|e| *e == key).count() as u32;
                let free = cap
                    .max_concurrent_calls
                    .saturating_sub(slots.in_flight(key));
                let would_queue = wanted.saturating_sub(free);
                would_queue > 0
                    && slots.queued(key) + would_queue as usize > cap.max_queued_calls as usize
            };
            let want = event.iter().find(|k| no_room(k)).copied();
            let got = slots.check(event.iter()).err().map(|refusal| refusal.key);
            assert_eq!(got, want, "seed {seed}: {event:?}, caps {caps:?}");
            for slot in held {
                let _ = slots.end(slot);
            }
        }
    }

    /// Thousands of operations drawn at random, checked against the invariants: a capped
    /// cluster never has more calls in flight than its cap (or than it had when a new
    /// configuration lowered the cap); a call waits only while every slot is taken; calls
    /// leave the line in the order they joined it; none is lost or sent twice.
    #[test]
    fn random_operations_keep_the_invariants() {
        const KEYS: [&str; 3] = ["a", "b", "c"];
        for seed in 0..20u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut slots: CallSlots<&str, u32> = CallSlots::new();
            let mut caps: HashMap<&str, CallCap> = HashMap::new();
            // Calls in flight, and per key the ids waiting, in the order they joined.
            let mut in_flight: Vec<(u32, &str, Slot)> = Vec::new();
            let mut line: HashMap<&str, VecDeque<u32>> = HashMap::new();
            let mut next_id = 0;
            for op in 0..3000 {
                let at = format!("seed {seed}, operation {op}");
                // The most each key may have in flight after this operation.
                let mut bound: HashMap<&str, u32> = KEYS
                    .iter()
                    .filter_map(|k| {
                        let cap = caps.get(k)?.max_concurrent_calls;
                        Some((*k, cap.max(slots.in_flight(k))))
                    })
                    .collect();
                let mut released = Vec::new();
                match rng.u8(..100) {
                    0..=2 => {
                        let mut new: Vec<(&str, CallCap)> = Vec::new();
                        for k in KEYS {
                            if rng.bool() {
                                new.push((k, cap(rng.u32(1..4), rng.u32(0..4))));
                            }
                        }
                        caps = new.iter().copied().collect();
                        bound = new
                            .iter()
                            .map(|(k, c)| (*k, c.max_concurrent_calls.max(slots.in_flight(k))))
                            .collect();
                        released = slots.set_caps(new);
                    }
                    3..=49 => {
                        let key = KEYS[rng.usize(..KEYS.len())];
                        next_id += 1;
                        match slots.start(&key, next_id) {
                            Start::Now(slot) => {
                                let waiting = line.get(key).map_or(0, VecDeque::len);
                                assert_eq!(waiting, 0, "{at}: {key} jumped the line");
                                in_flight.push((next_id, key, slot));
                            }
                            Start::Queued => line.entry(key).or_default().push_back(next_id),
                        }
                    }
                    50..=94 if !in_flight.is_empty() => {
                        let (_, _, slot) = in_flight.swap_remove(rng.usize(..in_flight.len()));
                        released.extend(slots.end(slot));
                    }
                    _ => {
                        let victim = next_id.saturating_sub(rng.u32(0..5));
                        let gone = slots.cancel(|id| *id == victim);
                        assert!(gone.iter().all(|id| *id == victim), "{at}");
                        for ids in line.values_mut() {
                            ids.retain(|id| !gone.contains(id));
                        }
                    }
                }
                for (id, slot) in released {
                    let key = slots.lanes[slot.lane].key;
                    let first = line.get_mut(key).and_then(VecDeque::pop_front);
                    assert_eq!(first, Some(id), "{at}: {key} let {id} out of order");
                    in_flight.push((id, key, slot));
                }
                for k in KEYS {
                    let flying = in_flight.iter().filter(|(_, key, _)| *key == k).count();
                    let waiting = line.get(k).map_or(0, VecDeque::len);
                    assert_eq!(slots.in_flight(&k) as usize, flying, "{at}: {k}");
                    assert_eq!(slots.queued(&k), waiting, "{at}: {k}");
                    match (caps.get(k), bound.get(k)) {
                        (Some(cap), Some(bound)) => {
                            assert!(flying <= *bound as usize, "{at}: {k} over {bound}");
                            let full = flying >= cap.max_concurrent_calls as usize;
                            assert!(full || waiting == 0, "{at}: {k} waits with a free slot");
                        }
                        _ => assert_eq!(waiting, 0, "{at}: {k} has no cap but a line"),
                    }
                }
            }
        }
    }

    #[test]
    fn gauges_list_every_cluster_seen() {
        let mut slots: CallSlots<&str, u32> = CallSlots::new();
        let _ = slots.set_caps([("a", cap(1, 5))]);
        let _held = slots.start(&"a", 1);
        let _ = slots.start(&"a", 2);
        let _other = slots.start(&"b", 3);
        let gauges: Vec<(&str, u32, usize)> = slots
            .gauges()
            .map(|g| (*g.key, g.in_flight, g.queued))
            .collect();
        assert_eq!(gauges, [("a", 1, 1), ("b", 1, 0)]);
        assert_eq!(slots.cap(&"a"), Some(cap(1, 5)));
        assert_eq!(slots.cap(&"b"), None);
        assert_eq!(slots.cap(&"never"), None);
    }

    #[test]
    fn a_refusal_answers_503_with_retry_after_naming_the_subscriber() {
        let mut slots: CallSlots<String, u32> = CallSlots::new();
        let _ = slots.set_caps([("billing".to_string(), cap(1, 0))]);
        let _slot = slots.start(&"billing".to_string(), 1);
        let refusal = slots
            .check([&"audit".to_string(), &"billing".to_string()])
            .unwrap_err();
        let answer = refusal.answer();
        assert_eq!(answer.status, 503);
        assert!(answer
            .headers
            .contains(&("retry-after", REFUSAL_RETRY_AFTER_SECS.to_string())));
        assert!(answer
            .headers
            .contains(&("content-type", "application/json".to_string())));
        let doc: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(doc["subscriber"], "billing");
        assert_eq!(doc["in_flight"], 1);
        assert_eq!(doc["queued"], 0);
        assert_eq!(doc["max_concurrent_calls"], 1);
        assert_eq!(doc["max_queued_calls"], 0);
        let error = doc["error"].as_str().unwrap();
        assert!(
            error.starts_with("subscriber billing has 1 call(s) in flight"),
            "{error}"
        );
        assert!(error.contains("not sent to any subscriber"), "{error}");
    }

    #[test]
    fn refusal_warnings_are_rate_limited_per_cluster_and_count_what_they_left_out() {
        let mut slots: CallSlots<&str, u32> = CallSlots::new();
        let every = REFUSAL_WARNING_INTERVAL_MS;
        let cases: &[(&str, u64, Option<u64>)] = &[
            ("a", 1000, Some(0)),
            ("a", 1001, None),
            ("a", 1000 + every - 1, None),
            // Another cluster has its own warnings.
            ("b", 1002, Some(0)),
            ("a", 1000 + every, Some(2)),
            ("a", 1000 + every, None),
            // A clock that went back (a new root context's) does not silence it for long.
            ("a", 10, Some(1)),
            ("b", 1002 + 3 * every, Some(0)),
        ];
        for (key, now, want) in cases {
            assert_eq!(slots.note_refusal(key, *now), *want, "{key} at {now}");
        }
    }
}
