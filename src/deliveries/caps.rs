//! `max_concurrent_calls` and `max_queued_calls`, the deliveries' side: a new event admitted
//! only when its first calls fit the capped clusters' lines, the calls that got a slot sent
//! from the root context's timer, and the capped clusters' gauges. The line itself is
//! [`SlotGate`](super::slot_gate::SlotGate).

use super::{Clock, Deliveries, Finished};
use crate::answer::Answer;
use crate::call_slots::CallCap;
use crate::config::Config;
use crate::host::Host;
use crate::telemetry::count_into;

impl Deliveries {
    /// Whether a new event whose first calls go to `clusters` fits every capped cluster's
    /// line (`max_queued_calls`); else the 503 naming the subscriber, counted and warned of
    /// (at most once per cluster per 10 s).
    pub fn admit<H: Host>(
        &mut self,
        host: &H,
        config: &Config,
        clusters: &[&str],
    ) -> Result<(), Answer> {
        let Err((refusal, warn)) = self.gate.admit(clusters, || host.now_ms()) else {
            return Ok(());
        };
        if let Some(unlogged) = warn {
            let earlier = if unlogged > 0 {
                format!(" ({unlogged} more since the last warning)")
            } else {
                String::new()
            };
            log::warn!("request refused: {}{earlier}", refusal.message());
        }
        self.count(host, config, |tally| tally.refused(&refusal.key));
        Err(refusal.answer())
    }

    /// Sends the calls that got a slot since the last tick, in the order they got it; each
    /// leaves its job's line as it goes.
    pub(super) fn send_released<H: Host>(
        &mut self,
        host: &H,
        clock: &Clock<'_, H>,
        root: u32,
    ) -> Vec<Finished> {
        let mut finished = Vec::new();
        while let Some(((id, index, leg), slot)) = self.gate.next_released() {
            if let Some(job) = self.jobs.get_mut(&id) {
                job.line.calls = job.line.calls.saturating_sub(1);
                job.line.left_at = Some(clock.now());
            }
            self.send_one(host, clock, Some(root), (id, index, leg), slot);
            finished.extend(self.pump(host, clock, Some(root), id));
        }
        finished
    }

    /// Counts how the capped clusters' calls in flight and waiting changed since the last tick.
    pub(super) fn report_gauges<H: Host>(&mut self, host: &H) {
        let gate = &mut self.gate;
        count_into(&self.telemetry, host, |tally| {
            gate.report_gauges(|change| {
                tally.call_gauges(change.cluster, change.in_flight, change.queued)
            });
        });
    }

    /// The caps of a (new) configuration; calls that now have room go out at the next tick.
    pub fn set_caps(&mut self, caps: &[(String, CallCap)]) {
        self.gate.set_caps(caps);
    }
}
