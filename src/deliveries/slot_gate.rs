//! The gate every call of the deliveries passes (`max_concurrent_calls`): the calls that got
//! a slot and wait for the root context's next tick, and the gauges last reported. (Each job counts its own calls in line: [`super::InLine`].)
//!
//! The policy (caps, the FIFO line, the admission of an event) is [`crate::call_slots`]'s;
//! this is the deliveries' bookkeeping around it, by job. It sends nothing: a slot handed
//! out is returned to the caller, who sends the call (the slot travels with the call's
//! entry in the [`CallTable`](crate::call_table::CallTable), and comes back here when it
//! ends).

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::call::Leg;
use crate::call_slots::{CallCap, CallSlots, Refusal, Slot, Start};

/// A call waiting for a slot: its job, its subscriber's index, its leg.
pub type Waiting = (u64, usize, Leg);

/// What a call asking for a slot gets.
#[derive(Debug, PartialEq, Eq)]
pub enum Pass {
    /// Send it now, holding this slot.
    Now(Slot),
    /// It waits in line; [`SlotGate::next_released`] hands it out later.
    Queued,
}

/// A cluster's calls in flight and waiting changed since the last report: the deltas.
#[derive(Debug, PartialEq, Eq)]
pub struct GaugeChange<'a> {
    pub cluster: &'a str,
    pub in_flight: i64,
    pub queued: i64,
}

#[derive(Default)]
pub struct SlotGate {
    /// Calls in flight and waiting per cluster, keyed by cluster.
    slots: CallSlots<String, Waiting>,
    /// Calls that got a slot, to be sent by the root context's next tick, in that order.
    released: VecDeque<(Waiting, Slot)>,
    /// The capped clusters' calls in flight and waiting as last reported.
    reported: HashMap<String, (u32, usize)>,
}

impl SlotGate {
    pub fn new() -> Self {
        SlotGate::default()
    }

    /// Whether a new event whose first calls go to `clusters` fits every capped cluster's
    /// line; else the refusal, and whether to warn of it at `now_ms` (`Some(n)`: `n`
    /// refusals went unlogged since the last warning).
    pub fn admit(
        &mut self,
        clusters: &[&str],
        now_ms: impl FnOnce() -> u64,
    ) -> Result<(), (Refusal<String>, Option<u64>)> {
        let Err(refusal) = self.slots.check(clusters.iter().copied()) else {
            return Ok(());
        };
        let warn = self.slots.note_refusal(&refusal.key, now_ms());
        Err((refusal, warn))
    }

    /// A call of job `waiting.0` to `cluster` is to be made. A worker that never had a cap,
    /// under a configuration without one (`capped` false), keeps no books: every call goes
    /// at once, uncounted. (Calls sent before the first cap arrives are not counted against
    /// it.) Otherwise a capped cluster's call may wait; an uncapped one's never does.
    pub fn pass(&mut self, capped: bool, cluster: &str, waiting: Waiting) -> Pass {
        if self.slots.is_unused() && !capped {
            return Pass::Now(Slot::uncounted());
        }
        match self.slots.start(&cluster.to_string(), waiting) {
            Start::Now(slot) => Pass::Now(slot),
            Start::Queued => Pass::Queued,
        }
    }

    /// A slot not (or no longer) held by a call is free: the next call waiting for its
    /// cluster, if any, takes it and is sent by the root context's next tick (Envoy ties a
    /// call to the context that makes it, and the root's calls outlive every stream).
    pub fn release(&mut self, slot: Slot) {
        if let Some(released) = self.slots.end(slot) {
            self.released.push_back(released);
        }
    }

    /// Job `id` is given up: its waiting calls leave the line. Call this before its calls
    /// in flight hand their slots back ([`SlotGate::release`]), so that none of its own
    /// waiting calls takes a freed slot.
    pub fn cancel_job(&mut self, id: u64) {
        self.slots.cancel(|waiting| waiting.0 == id);
        self.released.retain(|(waiting, _)| waiting.0 != id);
    }

    /// Whether calls wait for the next tick to be sent.
    pub fn has_released(&self) -> bool {
        !self.released.is_empty()
    }

    /// The next call that got a slot, in the order they got one, to be sent now.
    pub fn next_released(&mut self) -> Option<(Waiting, Slot)> {
        self.released.pop_front()
    }

    /// The caps of a (new) configuration; calls that now have room go out at the next tick.
    pub fn set_caps(&mut self, caps: &[(String, CallCap)]) {
        self.released
            .extend(self.slots.set_caps(caps.iter().cloned()));
    }

    /// How the capped clusters' calls in flight and waiting changed since the last call, each
    /// change given to `report` (a cluster whose cap went away is reported until it is back
    /// to zero).
    pub fn report_gauges(&mut self, mut report: impl FnMut(GaugeChange<'_>)) {
        for gauges in self.slots.gauges() {
            let last = self.reported.get(gauges.key).copied().unwrap_or((0, 0));
            let now = (gauges.in_flight, gauges.queued);
            if now == last || (self.slots.cap(gauges.key).is_none() && last == (0, 0)) {
                continue;
            }
            report(GaugeChange {
                cluster: gauges.key,
                in_flight: i64::from(now.0) - i64::from(last.0),
                queued: count_delta(now.1, last.1),
            });
            self.reported.insert(gauges.key.clone(), now);
        }
    }
}

/// `now - last` of two counts, saturated at i64's ends.
fn count_delta(now: usize, last: usize) -> i64 {
    let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    as_i64(now).saturating_sub(as_i64(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capped(cluster: &str, max_concurrent_calls: u32, max_queued_calls: u32) -> SlotGate {
        let mut gate = SlotGate::new();
        gate.set_caps(&[(
            cluster.to_string(),
            CallCap {
                max_concurrent_calls,
                max_queued_calls,
            },
        )]);
        gate
    }

    fn slot(pass: Pass) -> Slot {
        match pass {
            Pass::Now(slot) => slot,
            Pass::Queued => panic!("queued"),
        }
    }

    #[test]
    fn without_any_cap_calls_pass_uncounted() {
        let mut gate = SlotGate::new();
        assert_eq!(
            gate.pass(false, "a", (1, 0, Leg::Event)),
            Pass::Now(Slot::uncounted())
        );
        let mut changes = 0;
        gate.report_gauges(|_| changes += 1);
        assert_eq!(changes, 0);
        assert_eq!(gate.admit(&["a", "a"], || 0).map_err(|_| ()), Ok(()));
    }

    #[test]
    fn a_call_beyond_the_cap_waits_and_goes_when_a_slot_is_free() {
        let mut gate = capped("a", 1, 10);
        let first = slot(gate.pass(true, "a", (1, 0, Leg::Event)));
        assert_eq!(gate.pass(true, "a", (2, 0, Leg::Event)), Pass::Queued);
        assert_eq!(gate.pass(true, "a", (2, 1, Leg::Event)), Pass::Queued);
        gate.release(first);
        // The slot went to the first in line, to be sent at the next tick.
        assert!(gate.has_released());
        let (waiting, next) = gate.next_released().unwrap();
        assert_eq!(waiting, (2, 0, Leg::Event));
        assert!(
            !gate.has_released(),
            "one call of job 2 still waits for a slot"
        );
        gate.release(next);
        let (waiting, _) = gate.next_released().unwrap();
        assert_eq!(waiting, (2, 1, Leg::Event));
        assert!(gate.next_released().is_none());
    }

    #[test]
    fn an_uncapped_cluster_never_waits_once_the_gate_keeps_books() {
        let mut gate = capped("a", 1, 10);
        for index in 0..5 {
            assert!(matches!(
                gate.pass(true, "b", (1, index, Leg::Event)),
                Pass::Now(_)
            ));
        }
    }

    #[test]
    fn a_cancelled_job_takes_no_freed_slot() {
        let mut gate = capped("a", 1, 10);
        let held = slot(gate.pass(true, "a", (1, 0, Leg::Event)));
        assert_eq!(gate.pass(true, "a", (1, 1, Leg::Event)), Pass::Queued);
        assert_eq!(gate.pass(true, "a", (2, 0, Leg::Event)), Pass::Queued);
        gate.cancel_job(1);
        gate.release(held);
        let (waiting, _) = gate.next_released().unwrap();
        assert_eq!(waiting, (2, 0, Leg::Event));
        assert!(
            gate.next_released().is_none(),
            "job 1's waiting call is gone"
        );
    }

    #[test]
    fn an_event_that_would_wait_beyond_the_line_is_refused_and_warned_of_once() {
        let mut gate = capped("a", 1, 0);
        let held = slot(gate.pass(true, "a", (1, 0, Leg::Event)));
        let Err((refusal, warn)) = gate.admit(&["a"], || 1000) else {
            panic!("admitted");
        };
        assert_eq!(refusal.key, "a");
        assert_eq!(warn, Some(0));
        let Err((_, warn)) = gate.admit(&["a"], || 2000) else {
            panic!("admitted");
        };
        assert_eq!(warn, None, "at most one warning per interval");
        gate.release(held);
        assert!(gate.admit(&["a"], || 3000).is_ok());
    }

    #[test]
    fn gauges_report_changes_only() {
        let mut gate = capped("a", 1, 10);
        let held = slot(gate.pass(true, "a", (1, 0, Leg::Event)));
        assert_eq!(gate.pass(true, "a", (1, 1, Leg::Event)), Pass::Queued);
        let mut seen = Vec::new();
        gate.report_gauges(|c| seen.push((c.cluster.to_string(), c.in_flight, c.queued)));
        assert_eq!(seen, [("a".to_string(), 1, 1)]);
        seen.clear();
        gate.report_gauges(|c| seen.push((c.cluster.to_string(), c.in_flight, c.queued)));
        assert!(seen.is_empty(), "nothing changed");
        gate.release(held);
        gate.report_gauges(|c| seen.push((c.cluster.to_string(), c.in_flight, c.queued)));
        // The freed slot went to the waiting call: one in flight, none waiting.
        assert_eq!(seen, [("a".to_string(), 0, -1)]);
    }

    #[test]
    fn count_deltas_saturate() {
        assert_eq!(count_delta(3, 5), -2);
        // i64::MAX where usize is 64 bits; exact where it is 32 (wasm32).
        assert_eq!(
            count_delta(usize::MAX, 0),
            i64::try_from(usize::MAX).unwrap_or(i64::MAX)
        );
        assert_eq!(count_delta(0, usize::MAX), -count_delta(usize::MAX, 0));
    }
}
