//! The claim stage, with `dedupe`'s etcd store: a request's claim is asked of etcd before its
//! subscribers are called. With no claim txn of this worker in flight and a lease held, it
//! goes out at once from the request's stream (no added latency); otherwise the request is
//! *parked*, and when the txn in flight is answered the claims parked meanwhile go out as one
//! txn, a call of the root context (so under load an event costs a share of a claim txn).
//! Without a lease a request waits for one up to the store's timeout, then it is a store
//! error. However a claim went out, its answer (or the store's failure) is returned to the
//! pipeline as [`Claimed`], which continues each request in one place: launched, or answered
//! now.
//!
//! [`Coalescer`] is the bookkeeping: the txns in flight (until when their answer may come;
//! each is a [`Continuation::Claim`] of the call table) and the requests parked.

use super::{self as etcd, Found, Leases, StoreError, MAX_CLAIMS_PER_TXN, TXN_PATH};
use crate::call_table::{CallTable, Continuation};
use crate::dedupe::claim::{self, Ask};
use crate::dedupe::dedupe_store::Pending;
use crate::host::Host;

/// A claim txn in flight.
struct Flight<J> {
    token: u32,
    /// When its answer is overdue (its timeout and a margin).
    overdue_ms: u64,
    /// A call of the root context (else of the stream of its one request).
    of_root: bool,
    /// Its requests, in the txn's order.
    requests: Vec<Pending<J, Ask>>,
}

pub struct Coalescer<J> {
    flights: Vec<Flight<J>>,
    parked: Vec<Pending<J, Ask>>,
    /// Requests that could not be sent, for the root's timer to continue as store errors.
    failed: Vec<(Vec<Pending<J, Ask>>, StoreError)>,
}

impl<J> Default for Coalescer<J> {
    fn default() -> Self {
        Coalescer {
            flights: Vec::new(),
            parked: Vec::new(),
            failed: Vec::new(),
        }
    }
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

impl<J> Coalescer<J> {
    /// Whether a new claim must wait: `MAX_FLIGHTS` claim txns of this worker are in flight.
    fn must_park(&self) -> bool {
        self.flights.len() >= MAX_FLIGHTS
    }

    /// `requests` went out as call `token` at `now_ms`.
    fn sent(&mut self, token: u32, of_root: bool, requests: Vec<Pending<J, Ask>>, now_ms: u64) {
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
    pub fn landed(&mut self, token: u32) -> Option<Vec<Pending<J, Ask>>> {
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
    fn next_batch(&mut self) -> Option<Vec<Pending<J, Ask>>> {
        if self.must_park() || self.parked.is_empty() {
            return None;
        }
        let mut batch: Vec<Pending<J, Ask>> = Vec::new();
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
    fn unleased_past(&mut self, now_ms: u64) -> Vec<Pending<J, Ask>> {
        let (late, rest) = std::mem::take(&mut self.parked).into_iter().partition(|p| {
            p.ask.lease.is_none() && p.started_ms.saturating_add(timeout_ms(&p.ask)) <= now_ms
        });
        self.parked = rest;
        late
    }

    /// The stream of a request waiting for its claim ended (`ended`), or Envoy answered it:
    /// taken out if its claim is not sent yet (returns `true`); its own claim txn, which
    /// Envoy cancels with the stream, forgotten; else marked, so that nobody answers it.
    pub fn forget(&mut self, calls: &mut CallTable, stream: u32, ended: bool) -> bool {
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
        if let Some(token) = cancelled {
            calls.take(token);
            self.landed(token);
        }
        unsent
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

/// What the claim stage made of requests: each to be continued with what etcd found, or
/// with the store's failure (by the pipeline, in one place).
pub type Claimed<J> = Vec<(Pending<J, Ask>, Result<Found, StoreError>)>;

impl<J> Coalescer<J> {
    /// Takes the request `pending`: its claim goes out now, alone, as the stream's call if it
    /// can (its answer continues it), else it is parked. A claim Envoy refuses to send is
    /// returned, to go on as a store error.
    pub fn claim<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        leases: &Leases,
        mut pending: Pending<J, Ask>,
    ) -> Claimed<J> {
        let leased = pending.ask.lease_from(|until| leases.pick(until));
        if !leased || self.must_park() {
            self.parked.push(pending);
            return Vec::new();
        }
        let ask = &pending.ask;
        match host.dispatch(&ask.cluster, ask.headers(), &ask.body(), ask.timeout) {
            Ok(token) => {
                let now = pending.started_ms;
                calls.insert(token, Continuation::Claim, None);
                self.sent(token, false, vec![pending], now);
                Vec::new()
            }
            Err(failure) => {
                let error = StoreError::new(format!("refused at dispatch: {failure}"));
                vec![(pending, Err(error))]
            }
        }
    }

    /// Sends the requests parked (if no claim txn is in flight) as one txn of root context
    /// `root`, from whichever context runs: its answer goes to the root. `false`: Envoy
    /// refused it, and the root's timer must continue them soon as store errors.
    pub fn send_parked<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        leases: &Leases,
        root: u32,
    ) -> bool {
        if self.waits_for_a_lease() {
            for parked in self.parked.iter_mut() {
                parked.ask.lease_from(|until| leases.pick(until));
            }
        }
        let Some(batch) = self.next_batch() else {
            return true;
        };
        let Some(first) = batch.first() else {
            return true;
        };
        let (cluster, timeout) = (first.ask.cluster.clone(), first.ask.timeout);
        let asks: Vec<&Ask> = batch.iter().map(|p| &p.ask).collect();
        let body = claim::batch_body(&asks);
        let headers = etcd::call_headers(&cluster, TXN_PATH);
        match host.dispatch_for(root, &cluster, headers, &body, timeout) {
            Ok(token) => {
                calls.insert(token, Continuation::Claim, Some(root));
                self.sent(token, true, batch, host.now_ms());
                true
            }
            Err(failure) => {
                let error = StoreError::new(format!("refused at dispatch: {failure}"));
                self.failed.push((batch, error));
                false
            }
        }
    }

    /// The continuation of claim txn `token`: its answer read (before anything else is sent
    /// from this callback), each of its requests with what etcd found for it.
    pub fn answered<H: Host>(
        &mut self,
        host: &H,
        token: u32,
        (num_headers, body_size): (usize, usize),
    ) -> Claimed<J> {
        let Some(requests) = self.landed(token) else {
            return Vec::new();
        };
        let reply = claim::etcd_reply(host, num_headers, body_size);
        match claim::read_batch(&reply, requests.len()) {
            Ok(found) => requests
                .into_iter()
                .zip(found.into_iter().map(Ok))
                .collect(),
            Err(error) => requests
                .into_iter()
                .map(|pending| (pending, Err(error.clone())))
                .collect(),
        }
    }

    /// The root's timer: claim txns that could not be sent, whose answer is overdue, or
    /// that waited for a lease as long as a claim may take, to go on as store errors. (The
    /// clock is read only while a claim txn is in flight or a request waits for a lease:
    /// every tick runs this, with the etcd store or not.)
    pub fn tick<H: Host>(&mut self, host: &H, calls: &mut CallTable) -> Claimed<J> {
        let waits = self.waits_for_a_lease();
        if !self.flights.is_empty() || waits {
            let now = host.now_ms();
            if waits {
                let late = self.unleased_past(now);
                if !late.is_empty() {
                    let error = StoreError::new("no etcd lease granted within the store's timeout");
                    self.failed.push((late, error));
                }
            }
            for token in self.overdue(now) {
                calls.take(token);
                if let Some(batch) = self.landed(token) {
                    let error =
                        StoreError::new("no answer to the claim txn, long past its timeout");
                    self.failed.push((batch, error));
                }
            }
        }
        let mut claimed = Vec::new();
        for (batch, error) in std::mem::take(&mut self.failed) {
            claimed.extend(batch.into_iter().map(|p| (p, Err(error.clone()))));
        }
        claimed
    }
}
