//! What a worker still owes ([`Owed`], the itemised `fanout.in_flight`), and which root
//! context's calls are in flight (a retired root lives until its own calls are answered).

use super::Deliveries;

/// What a worker still owes: every fan-out not yet ended, by what it waits for. What
/// `fanout.in_flight` counts, itemised for the log line of a plugin retired with work owed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Owed {
    /// Fan-outs not ended (the gauge `fanout.in_flight`).
    pub fanouts: usize,
    /// Of those, their sender already answered: async, or best-effort deliveries after it.
    pub answered: usize,
    /// Of those, with a retry waiting for its backoff.
    pub retrying: usize,
    /// Calls in flight (events, dead letters, replies).
    pub calls: usize,
    /// Calls waiting for a slot (`max_concurrent_calls`).
    pub queued: usize,
}

impl std::fmt::Display for Owed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} fan-out(s) ({} already answered, {} with a retry waiting), {} call(s) in \
             flight, {} waiting for a slot",
            self.fanouts, self.answered, self.retrying, self.calls, self.queued
        )
    }
}

impl Deliveries {
    /// Call `token` was made for root context `root` outside its own callbacks (a claim
    /// batch, sent from a stream's): the root lives until it is answered.
    pub fn owned_by_root(&mut self, token: u32, root: u32) {
        self.root_of.insert(token, root);
    }
    /// Call `token` of a root context was answered or given up on.
    pub fn root_call_ended(&mut self, token: u32) {
        self.root_of.remove(&token);
    }
    /// Calls root context `root` made that are still in flight.
    pub fn open_calls_of(&self, root: u32) -> usize {
        self.root_of.values().filter(|r| **r == root).count()
    }
    /// Everything this worker still owes.
    pub fn owed(&self) -> Owed {
        Owed {
            fanouts: self.jobs.len(),
            answered: self.async_in_flight(),
            retrying: self
                .jobs
                .values()
                .filter(|job| job.fanout.waiting() > 0)
                .count(),
            calls: self.tokens.len(),
            queued: self.jobs.values().map(|job| job.line.calls).sum(),
        }
    }
    /// Fan-outs delivering in the background, their sender answered (async mode, channels
    /// of best-effort subscribers, best-effort deliveries after the answer): what
    /// `max_in_flight` bounds.
    pub fn async_in_flight(&self) -> usize {
        self.jobs
            .values()
            .filter(|job| job.answer_to.is_none())
            .count()
    }

    /// Whether job `id`'s sender still waits for its answer.
    pub fn awaits_answer(&self, id: u64) -> bool {
        self.jobs
            .get(&id)
            .is_some_and(|job| job.answer_to.is_some())
    }
    /// Whether the root context's timer has work: calls to send or retries waiting.
    pub fn has_timed_work(&self) -> bool {
        self.jobs
            .values()
            .any(|job| job.fanout.has_ready() || job.fanout.waiting() > 0)
            || self.gate.has_released()
    }
}
