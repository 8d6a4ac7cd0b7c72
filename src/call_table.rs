//! One worker's calls in flight: the one map from a call's token to what its answer
//! continues (a delivery attempt, a claim txn, a settle txn, a lease grant, a span export),
//! and the root context that made it, if a root did.
//!
//! Whoever dispatches a call enters it here with its continuation; when Envoy hands an answer
//! to any context, the token is looked up once and its continuation runs. Nobody else is
//! asked whether a token is theirs. It decides nothing: it is the pipeline's book of calls.

use hashbrown::HashMap;

use crate::call_slots::Slot;

/// What the answer to a call continues.
#[derive(Debug, PartialEq, Eq)]
pub enum Continuation {
    /// A delivery's call (an event, a reply, a dead letter).
    Delivery(Attempt),
    /// A claim txn of the etcd store (its requests wait in the claim stage).
    Claim,
    /// A settle txn of the etcd store (its settles wait in the settle stage).
    Settle,
    /// A lease grant of the etcd store.
    Grant,
    /// A batch of spans to the OTLP collector.
    Export,
}

/// A delivery's call in flight: its job, its subscriber's index, and the
/// `max_concurrent_calls` slot it holds (handed back when it ends).
#[derive(Debug, PartialEq, Eq)]
pub struct Attempt {
    pub job: u64,
    pub index: usize,
    pub slot: Slot,
}

/// The calls in flight, by token.
#[derive(Default)]
pub struct CallTable {
    calls: HashMap<u32, (Continuation, Option<u32>)>,
}

impl CallTable {
    /// Call `token` went out; its answer continues `then`. `root`: the root context that
    /// made it (its calls outlive every stream; a retired root waits for them), `None` for a
    /// stream's.
    #[inline]
    pub fn insert(&mut self, token: u32, then: Continuation, root: Option<u32>) {
        self.calls.insert(token, (then, root));
    }

    /// The answer to call `token` came (or it is given up on): its continuation, once.
    #[inline]
    pub fn take(&mut self, token: u32) -> Option<Continuation> {
        self.calls.remove(&token).map(|(then, _)| then)
    }

    /// Job `job` is over: its deliveries' calls in flight are forgotten (their answers find
    /// nothing); their slots are returned, to be handed back.
    pub fn forget_job(&mut self, job: u64) -> Vec<Slot> {
        let tokens: Vec<u32> = self
            .calls
            .iter()
            .filter(|(_, (then, _))| matches!(then, Continuation::Delivery(a) if a.job == job))
            .map(|(token, _)| *token)
            .collect();
        tokens
            .into_iter()
            .filter_map(|token| match self.calls.remove(&token) {
                Some((Continuation::Delivery(attempt), _)) => Some(attempt.slot),
                _ => None,
            })
            .collect()
    }

    /// Calls root context `root` made that are still in flight.
    pub fn of_root(&self, root: u32) -> usize {
        self.calls
            .values()
            .filter(|(_, r)| *r == Some(root))
            .count()
    }

    /// Deliveries' calls in flight (events, replies, dead letters).
    pub fn deliveries(&self) -> usize {
        self.calls
            .values()
            .filter(|(then, _)| matches!(then, Continuation::Delivery(_)))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(job: u64, index: usize) -> Continuation {
        Continuation::Delivery(Attempt {
            job,
            index,
            slot: Slot::uncounted(),
        })
    }

    #[test]
    fn an_answer_finds_its_continuation_once() {
        let mut table = CallTable::default();
        table.insert(7, attempt(1, 0), None);
        table.insert(8, Continuation::Settle, Some(2));
        assert_eq!(table.take(7), Some(attempt(1, 0)));
        assert_eq!(table.take(7), None, "once");
        assert_eq!(table.take(8), Some(Continuation::Settle));
        assert_eq!(table.take(9), None, "nobody's");
    }

    #[test]
    fn a_job_over_forgets_its_calls_and_only_its_own() {
        let mut table = CallTable::default();
        table.insert(1, attempt(1, 0), Some(3));
        table.insert(2, attempt(1, 1), None);
        table.insert(3, attempt(2, 0), Some(3));
        table.insert(4, Continuation::Claim, Some(3));
        assert_eq!(table.forget_job(1).len(), 2);
        assert_eq!(table.deliveries(), 1);
        assert_eq!(table.of_root(3), 2);
        assert_eq!(table.take(2), None);
    }
}
