//! What a worker still owes ([`Owed`], the itemised `fanout.in_flight`).

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
