//! The claim stage, with `dedupe`'s etcd store: a request's claim is asked of etcd before its
//! subscribers are called. With no claim txn of this worker in flight and a lease held, it
//! goes out at once from the request's stream (no added latency); otherwise the request is
//! *parked*, and when the txn in flight is answered the claims parked meanwhile go out as one
//! txn, a call of the root context (so under load an event costs a share of a claim txn).
//! Without a lease a request waits for one up to the store's timeout, then it is a store
//! error. However a claim went out, its answer (or the store's failure) continues the request
//! in one place, [`Pipeline::continue_claim`]: launched, or answered now.
//!
//! [`Coalescer`] is the bookkeeping: the txns in flight (until when their answer may come;
//! each is a [`Continuation::Claim`] of the call table) and the requests parked.

use super::{Actor, Pipeline};
use crate::call_table::Continuation;
use crate::dedupe::claim::{self, Ask};
use crate::dedupe::etcd::{self, Found, StoreError, MAX_CLAIMS_PER_TXN, TXN_PATH};
use crate::dedupe::remote;
use crate::deliveries::{Finished, Job};
use crate::host::Host;

/// A request waiting for its claim: its stream, its claim, and its fan-out, ready to start
/// once claimed.
pub struct Pending {
    pub stream: u32,
    pub ask: Ask,
    pub job: Job,
    /// Its stream ended (or Envoy answered it) while its claim was in a txn in flight:
    /// nobody to answer.
    pub sender_left: bool,
}

impl Pending {
    pub fn new(stream: u32, ask: Ask, job: Job) -> Pending {
        Pending {
            stream,
            ask,
            job,
            sender_left: false,
        }
    }
}

/// A claim txn in flight.
struct Flight {
    token: u32,
    /// When its answer is overdue (its timeout and a margin).
    overdue_ms: u64,
    /// A call of the root context (else of the stream of its one request).
    of_root: bool,
    /// Its requests, in the txn's order.
    requests: Vec<Pending>,
}

/// What [`Coalescer::forget`] did.
pub struct Forgotten {
    /// The request was parked, not sent: taken out.
    pub unsent: bool,
    /// Its stream's own claim txn, which Envoy cancels with the stream.
    pub cancelled: Option<u32>,
}

#[derive(Default)]
pub struct Coalescer {
    flights: Vec<Flight>,
    parked: Vec<Pending>,
    /// Requests that could not be sent, for the root's timer to continue as store errors.
    failed: Vec<(Vec<Pending>, StoreError)>,
}

/// Claim txns a worker has in flight at most: the others wait to go out together. (Two in
/// flight measured no better: more txns, the same throughput, bench/README.md.)
const MAX_FLIGHTS: usize = 1;

/// How long after its timeout a claim txn's answer is given up on (Envoy answers a timed-out
/// call itself; this is for an answer that never comes at all).
const OVERDUE_MARGIN_MS: u64 = 1_000;

fn timeout_ms(ask: &Ask) -> u64 {
    u64::try_from(ask.timeout.as_millis()).unwrap_or(u64::MAX)
}

impl Coalescer {
    /// Whether a new claim must wait: `MAX_FLIGHTS` claim txns of this worker are in flight.
    fn must_park(&self) -> bool {
        self.flights.len() >= MAX_FLIGHTS
    }

    /// `requests` went out as call `token` at `now_ms`.
    fn sent(&mut self, token: u32, of_root: bool, requests: Vec<Pending>, now_ms: u64) {
        let timeout = requests.first().map_or(0, |p| timeout_ms(&p.ask));
        self.flights.push(Flight {
            token,
            overdue_ms: now_ms
                .saturating_add(timeout)
                .saturating_add(OVERDUE_MARGIN_MS),
            of_root,
            requests,
        });
    }

    /// The claim txn `token` was answered (or given up on, or cancelled): its requests, if
    /// it is one.
    #[inline]
    pub fn landed(&mut self, token: u32) -> Option<Vec<Pending>> {
        if self.flights.is_empty() {
            return None;
        }
        let at = self.flights.iter().position(|f| f.token == token)?;
        Some(self.flights.swap_remove(at).requests)
    }

    /// The txns in flight whose answer is overdue at `now_ms`.
    fn overdue(&self, now_ms: u64) -> Vec<u32> {
        self.flights
            .iter()
            .filter(|f| f.overdue_ms <= now_ms)
            .map(|f| f.token)
            .collect()
    }

    /// The next batch to send, if no claim txn is in flight and requests are parked: the
    /// oldest parked, and those after it that fit one txn (the same cluster and timeout, at
    /// most [`MAX_CLAIMS_PER_TXN`] claims, no key twice). The others stay parked.
    fn next_batch(&mut self) -> Option<Vec<Pending>> {
        if self.must_park() || self.parked.is_empty() {
            return None;
        }
        let mut batch: Vec<Pending> = Vec::new();
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

    /// Whether a parked request waits for a lease.
    fn waits_for_a_lease(&self) -> bool {
        self.parked.iter().any(|p| p.ask.lease.is_none())
    }

    /// The parked requests still without a lease when their store's timeout (counted from
    /// their start) is over at `now_ms`: taken out, to go on as store errors.
    fn unleased_past(&mut self, now_ms: u64) -> Vec<Pending> {
        let (late, rest) = std::mem::take(&mut self.parked).into_iter().partition(|p| {
            p.ask.lease.is_none() && p.job.started_ms.saturating_add(timeout_ms(&p.ask)) <= now_ms
        });
        self.parked = rest;
        late
    }

    /// The stream of a request waiting for its claim ended (`ended`), or Envoy answered it:
    /// taken out if its claim is not sent yet; else marked, so that nobody answers it.
    pub fn forget(&mut self, stream: u32, ended: bool) -> Forgotten {
        let before = self.parked.len();
        self.parked.retain(|p| p.stream != stream);
        let unsent = self.parked.len() != before;
        let own = self
            .flights
            .iter()
            .find(|f| !f.of_root && f.requests.iter().any(|p| p.stream == stream));
        let cancelled = own.filter(|_| ended).map(|f| f.token);
        if !unsent && cancelled.is_none() {
            let waiting = self.flights.iter_mut().flat_map(|f| &mut f.requests);
            let failed = self.failed.iter_mut().flat_map(|(b, _)| b);
            for pending in waiting.chain(failed).filter(|p| p.stream == stream) {
                pending.sender_left = true;
            }
        }
        Forgotten { unsent, cancelled }
    }

    /// Whether the request of `stream` still waits for its claim.
    pub fn holds(&self, stream: u32) -> bool {
        self.parked
            .iter()
            .chain(self.flights.iter().flat_map(|f| &f.requests))
            .chain(self.failed.iter().flat_map(|(b, _)| b))
            .any(|p| p.stream == stream)
    }

    /// Whether the root's timer must run soon: requests that could not be sent, or that wait
    /// for a lease. (An overdue answer is noticed at the slow tick: it only ever happens when
    /// Envoy loses one.)
    pub fn needs_tick(&self) -> bool {
        !self.failed.is_empty() || self.waits_for_a_lease()
    }
}

impl Pipeline {
    /// The claim stage takes the request `pending` of stream `actor`: its claim goes out
    /// now, alone, from the stream if it can, else it is parked.
    pub(super) fn claim<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        mut pending: Pending,
    ) -> Vec<Finished> {
        let leases = &self.etcd.leases;
        let leased = pending.ask.lease_from(|until| leases.pick(until));
        if !leased || self.claims.must_park() {
            self.claims.parked.push(pending);
            return Vec::new();
        }
        let ask = &pending.ask;
        match host.dispatch(&ask.cluster, ask.headers(), &ask.body(), ask.timeout) {
            Ok(token) => {
                let now = pending.job.started_ms;
                self.calls.insert(token, Continuation::Claim, None);
                self.claims.sent(token, false, vec![pending], now);
                Vec::new()
            }
            Err(failure) => {
                let error = StoreError::new(format!("refused at dispatch: {failure}"));
                self.continue_claim(host, actor, pending, Err(error))
            }
        }
    }

    /// Sends the requests parked (if no claim txn is in flight) as one txn of the root
    /// context, from whichever context runs: its answer goes to the root, which continues
    /// them (`claim_answered`).
    pub(super) fn send_parked<H: Host>(&mut self, host: &H, actor: Actor) {
        if self.claims.waits_for_a_lease() {
            let leases = &self.etcd.leases;
            for parked in self.claims.parked.iter_mut() {
                parked.ask.lease_from(|until| leases.pick(until));
            }
        }
        let Some(batch) = self.claims.next_batch() else {
            return;
        };
        let Some(first) = batch.first() else {
            return;
        };
        let (cluster, timeout) = (first.ask.cluster.clone(), first.ask.timeout);
        let asks: Vec<&Ask> = batch.iter().map(|p| &p.ask).collect();
        let body = claim::batch_body(&asks);
        let headers = etcd::call_headers(&cluster, TXN_PATH);
        let root = actor.root();
        match host.dispatch_for(root, &cluster, headers, &body, timeout) {
            Ok(token) => {
                self.calls.insert(token, Continuation::Claim, Some(root));
                self.claims.sent(token, true, batch, host.now_ms());
            }
            Err(failure) => {
                let error = StoreError::new(format!("refused at dispatch: {failure}"));
                self.claims.failed.push((batch, error));
                self.timers.hurry(host, root, remote::SETTLE_TICK);
            }
        }
    }

    /// The continuation of claim txn `token`: continues every request in it (its answer
    /// read before anything else is sent from this callback), and sends the claims parked
    /// since.
    pub(super) fn claim_answered<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        token: u32,
        (num_headers, body_size): (usize, usize),
    ) -> Vec<Finished> {
        let Some(requests) = self.claims.landed(token) else {
            return Vec::new();
        };
        let reply = claim::etcd_reply(host, num_headers, body_size);
        let results = claim::read_batch(&reply, requests.len());
        self.send_parked(host, actor);
        let mut finished = Vec::new();
        match results {
            Ok(found) => {
                for (pending, found) in requests.into_iter().zip(found) {
                    finished.extend(self.continue_claim(host, actor, pending, Ok(found)));
                }
            }
            Err(error) => {
                for pending in requests {
                    finished.extend(self.continue_claim(host, actor, pending, Err(error.clone())));
                }
            }
        }
        finished
    }

    /// The root's timer: claim txns that could not be sent, whose answer is overdue, or
    /// that waited for a lease as long as a claim may take go on as store errors; then the
    /// claims parked since go out. (The clock is read only while a claim txn is in flight
    /// or a request waits for a lease: every tick runs this, with the etcd store or not.)
    pub(super) fn tick_claims<H: Host>(&mut self, host: &H, actor: Actor) -> Vec<Finished> {
        let waits = self.claims.waits_for_a_lease();
        let in_flight = !self.claims.flights.is_empty();
        if in_flight || waits {
            let now = host.now_ms();
            if waits {
                let late = self.claims.unleased_past(now);
                if !late.is_empty() {
                    let error = StoreError::new("no etcd lease granted within the store's timeout");
                    self.claims.failed.push((late, error));
                }
            }
            for token in self.claims.overdue(now) {
                self.calls.take(token);
                if let Some(batch) = self.claims.landed(token) {
                    let error =
                        StoreError::new("no answer to the claim txn, long past its timeout");
                    self.claims.failed.push((batch, error));
                }
            }
        }
        let mut finished = Vec::new();
        for (batch, error) in std::mem::take(&mut self.claims.failed) {
            for pending in batch {
                finished.extend(self.continue_claim(host, actor, pending, Err(error.clone())));
            }
        }
        self.send_parked(host, actor);
        finished
    }

    /// The one continuation of a claim: etcd found what it found (the job's fan-out marked,
    /// its claims kept to settle) and the fan-out starts; or the store failed, and
    /// `on_store_error` decides: everyone is called, unrecorded, or the 503. What the stream
    /// must answer is returned (counted where it is sent).
    pub(super) fn continue_claim<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        pending: Pending,
        result: Result<Found, StoreError>,
    ) -> Vec<Finished> {
        let Pending {
            stream,
            ask,
            mut job,
            sender_left,
        } = pending;
        let counter = self.counter(&job.config);
        match result {
            Ok(found) => job.claims = claim::claimed(host, &counter, ask, &found, &mut job.fanout),
            Err(error) => {
                let now = job.started_ms;
                let etcd = &mut self.etcd;
                if error.lease_lost() {
                    etcd.leases.forget();
                }
                let failed =
                    claim::store_failed(host, &counter, &job.config, stream, &error, || {
                        etcd.warn(now)
                    });
                if let Err(answer) = failed {
                    if sender_left {
                        return Vec::new();
                    }
                    return vec![Finished::now(stream, answer)];
                }
                job.unrecorded = true;
            }
        }
        self.launch(host, actor.acting_root(), (stream, sender_left), job)
    }
}
