//! The etcd store's claims, coalesced: a request whose claim comes while another claim txn of
//! this worker is in flight waits (it is *parked*), and when that txn is answered the claims
//! parked meanwhile go out as one txn, made for the root context, whose answer continues
//! every request in it. So at low load a claim goes out at once (nothing is in flight: no
//! added latency) and under load an event costs a share of one claim txn, not a whole one.
//!
//! Pure bookkeeping: which txns are in flight (and until when they can be answered, in case
//! their answer never comes), the requests parked, the batches sent, and what the root made of
//! a parked request (for its stream to pick up at its next callback). The calls are made by
//! the stream and the plugin.

use super::Job;
use crate::dedupe::claim::Ask;
use crate::dedupe::etcd::StoreError;
use crate::dedupe::etcd::MAX_CLAIMS_PER_TXN;

/// A request waiting for its claim: its stream, its claim, and its fan-out, ready to start
/// once claimed.
pub struct Parked {
    pub stream: u32,
    pub ask: Ask,
    pub job: Job,
}

/// What the root made of a parked request, for its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continued {
    /// Answered (a 202 in async mode, a 409, a 503).
    Answered,
    /// A sync fan-out under way: the deliveries' job.
    Delivering(u64),
}

#[derive(Default)]
pub struct Coalescer {
    /// Claim txns in flight (one request's or a batch's): token and when their answer is
    /// overdue (timeout and a margin).
    flights: Vec<(u32, u64)>,
    parked: Vec<Parked>,
    /// Batches sent: token and the requests in it, in the txn's order.
    batches: Vec<(u32, Vec<Parked>)>,
    /// Batches that could not be sent, for the root's timer to continue as store errors.
    failed: Vec<(Vec<Parked>, StoreError)>,
    /// (Few at a time: a stream picks its entry up at its next callback. Vectors, not maps:
    /// each map type costs the module kilobytes.)
    continued: Vec<(u32, Continued)>,
    /// Streams that ended (or were answered by Envoy) while their request was in a batch in
    /// flight: nobody to answer.
    gone: Vec<u32>,
}

/// Claim txns a worker has in flight at most: the others wait to go out together. (Two in
/// flight measured no better: more txns, the same throughput, bench/README.md.)
const MAX_FLIGHTS: usize = 1;

/// How long after its timeout a claim txn's answer is given up on (Envoy answers a timed-out
/// call itself; this is for an answer that never comes at all).
const OVERDUE_MARGIN_MS: u64 = 1_000;

impl Coalescer {
    /// Whether a new claim must wait: `MAX_FLIGHTS` claim txns of this worker are in
    /// flight.
    pub fn must_park(&self) -> bool {
        self.flights.len() >= MAX_FLIGHTS
    }

    /// Whether any claim txn of this worker is in flight.
    pub fn in_flight(&self) -> bool {
        !self.flights.is_empty()
    }

    pub fn park(&mut self, parked: Parked) {
        self.parked.push(parked);
    }

    /// A claim txn went out as call `token`, `timeout_ms` long, at `now_ms`.
    pub fn flying(&mut self, token: u32, now_ms: u64, timeout_ms: u64) {
        let overdue = now_ms
            .saturating_add(timeout_ms)
            .saturating_add(OVERDUE_MARGIN_MS);
        self.flights.push((token, overdue));
    }

    /// The claim txn `token` was answered (or given up on, or cancelled): returns the
    /// requests in it if it was a batch.
    pub fn landed(&mut self, token: u32) -> Option<Vec<Parked>> {
        self.flights.retain(|(t, _)| *t != token);
        let at = self.batches.iter().position(|(t, _)| *t == token)?;
        Some(self.batches.swap_remove(at).1)
    }

    /// Whether `token` is a batch's.
    pub fn is_batch(&self, token: u32) -> bool {
        self.batches.iter().any(|(t, _)| *t == token)
    }

    /// The txns in flight whose answer is overdue at `now_ms`.
    pub fn overdue(&self, now_ms: u64) -> Vec<u32> {
        self.flights
            .iter()
            .filter(|(_, overdue)| *overdue <= now_ms)
            .map(|(t, _)| *t)
            .collect()
    }

    /// The next batch to send, if no claim txn is in flight and requests are parked: the
    /// oldest parked, and those after it that fit one txn (the same cluster and timeout, at
    /// most [`MAX_CLAIMS_PER_TXN`] claims, no key twice). The others stay parked.
    pub fn next_batch(&mut self) -> Option<Vec<Parked>> {
        if self.must_park() || self.parked.is_empty() {
            return None;
        }
        let mut batch: Vec<Parked> = Vec::new();
        let mut rest = Vec::new();
        for parked in std::mem::take(&mut self.parked) {
            let fits = match batch.first() {
                // Without a lease it waits for one.
                _ if parked.ask.lease.is_none() => false,
                None => true,
                Some(first) => {
                    first.ask.cluster == parked.ask.cluster
                        && first.ask.timeout == parked.ask.timeout
                        && batch.len() < MAX_CLAIMS_PER_TXN
                        && !batch.iter().any(|b| b.ask.shares_a_key(&parked.ask))
                }
            };
            if fits {
                batch.push(parked);
            } else {
                rest.push(parked);
            }
        }
        self.parked = rest;
        (!batch.is_empty()).then_some(batch)
    }

    /// Gives the parked requests without a lease the one `pick` has for them, if any.
    pub fn lease(&mut self, pick: impl Fn(u64) -> Option<i64>) {
        for parked in self.parked.iter_mut() {
            parked.ask.lease_from(&pick);
        }
    }

    /// Whether a parked request waits for a lease.
    pub fn waits_for_a_lease(&self) -> bool {
        self.parked.iter().any(|p| p.ask.lease.is_none())
    }

    /// The parked requests still without a lease when their store's timeout (counted from
    /// their start) is over at `now_ms`: taken out, to go on as store errors.
    pub fn unleased_past(&mut self, now_ms: u64) -> Vec<Parked> {
        let (late, rest) = std::mem::take(&mut self.parked).into_iter().partition(|p| {
            let timeout = u64::try_from(p.ask.timeout.as_millis()).unwrap_or(u64::MAX);
            p.ask.lease.is_none() && p.job.started_ms.saturating_add(timeout) <= now_ms
        });
        self.parked = rest;
        late
    }

    /// `batch` went out as call `token`.
    pub fn sent(&mut self, token: u32, batch: Vec<Parked>, now_ms: u64) {
        let timeout = batch
            .first()
            .map(|p| u64::try_from(p.ask.timeout.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        self.flying(token, now_ms, timeout);
        self.batches.push((token, batch));
    }

    /// `batch` could not be sent: the root's timer continues it (`error` for each).
    pub fn not_sent(&mut self, batch: Vec<Parked>, error: StoreError) {
        self.failed.push((batch, error));
    }

    pub fn take_failed(&mut self) -> Vec<(Vec<Parked>, StoreError)> {
        std::mem::take(&mut self.failed)
    }

    /// The stream of a parked request ended, or Envoy answered it: taken out if its claim
    /// is not sent yet (true), else marked, so that the root does not answer it.
    pub fn forget(&mut self, stream: u32) -> bool {
        let before = self.parked.len();
        self.parked.retain(|p| p.stream != stream);
        if self.parked.len() != before {
            return true;
        }
        let in_flight = self
            .batches
            .iter()
            .flat_map(|(_, b)| b)
            .chain(self.failed.iter().flat_map(|(b, _)| b))
            .any(|p| p.stream == stream);
        if in_flight && !self.gone.contains(&stream) {
            self.gone.push(stream);
        }
        false
    }

    /// Whether the stream of a request being continued is gone (once).
    pub fn take_gone(&mut self, stream: u32) -> bool {
        let before = self.gone.len();
        self.gone.retain(|s| *s != stream);
        self.gone.len() != before
    }

    /// The root continued the parked request of `stream`.
    pub fn continued(&mut self, stream: u32, what: Continued) {
        self.continued.retain(|(s, _)| *s != stream);
        self.continued.push((stream, what));
    }

    /// What the root made of `stream`'s parked request, if it did (once).
    pub fn adopt(&mut self, stream: u32) -> Option<Continued> {
        let at = self.continued.iter().position(|(s, _)| *s == stream)?;
        Some(self.continued.swap_remove(at).1)
    }

    /// Whether the root's timer must run soon: batches that could not be sent wait for it.
    /// (An overdue answer is noticed at the slow tick: it only ever happens when Envoy loses
    /// one.)
    pub fn needs_tick(&self) -> bool {
        !self.failed.is_empty() || self.waits_for_a_lease()
    }

    /// Requests parked or in a batch in flight (waiting for their claim).
    pub fn waiting(&self) -> usize {
        self.parked.len()
            + self.batches.iter().map(|(_, b)| b.len()).sum::<usize>()
            + self.failed.iter().map(|(b, _)| b.len()).sum::<usize>()
    }
}
