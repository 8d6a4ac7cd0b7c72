//! One request's way through a worker once its recipients are chosen, as named stages, each
//! coded in one place:
//!
//! 1. **claim** (`dedupe/etcd/claims.rs`): with `dedupe`'s etcd store, the event's claim is asked of etcd
//!    first (alone from the request's stream, or coalesced with others' as a call of the root
//!    context), and its answer (or the store's failure) decides who is called;
//! 2. **deliver** ([`Deliveries`]): the calls, their retries, the verdict;
//! 3. **settle** (`settles.rs`): when the fan-out ends, its claims are settled (in Envoy's
//!    shared data at once; in etcd as a txn of the root context);
//! 4. **answer**: the sender's answer goes out, a sync one with the etcd store only once etcd
//!    has its settle. The pipeline never answers a sender itself: it returns each answer
//!    ([`Finished`]) to the context that runs, which sends it (no `RefCell` borrowed while
//!    Envoy runs the local reply).
//!
//! A stage that calls out enters the call's token in the worker's one [`CallTable`] with its
//! continuation (a delivery attempt, a claim txn, a settle txn, a lease grant, an export);
//! whichever context Envoy hands the answer to, [`Pipeline::on_response`] looks the token up
//! once and runs that continuation. Every entry point says which context runs ([`Actor`]):
//! the calls made from a root context's callbacks are the root's, those from a stream's the
//! stream's (Envoy cancels them when it ends).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use crate::answer::Answer;
use crate::call_table::{CallTable, Continuation};
use crate::cloudevents::ContentMode;
use crate::config::Config;
use crate::dedupe::claim::{self as dedupe_claim, Claim};
use crate::dedupe::etcd::claims::{Claimed, Coalescer, Pending};
use crate::dedupe::etcd::remote::{self, Remote};
use crate::dedupe::etcd::{Found, StoreError};
use crate::dedupe::settle;
use crate::deliveries::{Deliveries, Finished, Job, JobSpans, Outcome, Owed};
use crate::headers::HeaderMap;
use crate::host::Host;
use crate::jitter::Jitter;
use crate::recipients::Room;
use crate::telemetry::{Counter, Telemetry};
use crate::timer::Timers;

mod settles;

/// The context whose callback is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Actor {
    /// A root context (its id).
    Root(u32),
    /// A stream (its id), made by root context `root`.
    Stream { id: u32, root: u32 },
}

impl Actor {
    /// The root context whose calls the etcd store's batches are.
    fn root(self) -> u32 {
        match self {
            Actor::Root(root) | Actor::Stream { root, .. } => root,
        }
    }

    fn acting_root(self) -> Option<u32> {
        match self {
            Actor::Root(root) => Some(root),
            Actor::Stream { .. } => None,
        }
    }
}

/// Every request of one worker past its recipients: the claims, the deliveries, the
/// settles, the answers held for them. Shared by the VM's root contexts and their streams.
pub struct Pipeline {
    /// The worker's calls in flight, each with what its answer continues.
    calls: CallTable,
    deliveries: Deliveries,
    /// The claim stage: claim txns in flight, requests parked, what the root made of them.
    claims: Coalescer<Job>,
    /// The etcd store's agent on this VM: leases, settles queued and in flight, warnings.
    etcd: Remote,
    /// The answer stage: sync fan-outs ended whose answer waits for their etcd settle (job
    /// id, answer).
    held: Vec<(u64, Finished)>,
    /// The root contexts' timers.
    timers: Timers,
    telemetry: Rc<RefCell<Telemetry>>,
}

impl Pipeline {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        Pipeline {
            calls: CallTable::default(),
            deliveries: Deliveries::new(telemetry.clone()),
            claims: Coalescer::default(),
            etcd: Remote::default(),
            held: Vec::new(),
            timers: Timers::default(),
            telemetry,
        }
    }

    /// A (new) configuration of root context `root`: `dedupe`'s store (the shard keys
    /// created in Envoy's shared data, or the etcd store's lease kinds), the call caps, the
    /// tracing, the retry jitter's seed.
    pub fn configure<H: Host>(&mut self, host: &H, config: &Config, root: u32) {
        settle::prepare(host, config);
        remote::prepare(&mut self.etcd, config);
        self.deliveries.set_caps(&config.call_caps);
        let tracing = config.tracing.as_ref();
        self.deliveries
            .configure_tracing(host, tracing, config.metrics, root);
        if config
            .channels
            .iter()
            .flat_map(|c| &c.subscribers)
            .any(|s| s.backoff_jitter != Jitter::NONE)
        {
            self.deliveries.seed_jitter(host, root);
        }
    }

    /// The request of stream `actor`, its recipients chosen (`job`) and its claims made or to
    /// ask (`claim`): straight to the deliveries, or into the claim stage. What it made of
    /// the request ([`Outcome`]): a sync fan-out under way, the answers due now; waiting for its
    /// claim, neither (the claim's answer continues it).
    pub fn begin<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        mut job: Job,
        claim: Claim,
    ) -> Outcome {
        let stream = job.log_id;
        let mut outcome = match claim {
            Claim::Done(claims) => {
                job.claims = claims;
                let root = actor.acting_root();
                self.deliveries
                    .launch(host, &mut self.calls, root, job, stream)
            }
            Claim::Ask(ask) => {
                let (calls, leases) = (&mut self.calls, &self.etcd.leases);
                let pending = Pending::new(stream, ask, job.started_ms, job);
                let claimed = self.claims.claim(host, calls, leases, pending);
                Outcome {
                    delivering: None,
                    finished: self.continue_claims(host, actor, claimed),
                }
            }
        };
        self.settle_ended(host, actor, &mut outcome.finished);
        outcome
    }

    /// The answer to call `token`, delivered to `actor`: its continuation, looked up once in
    /// the call table, runs (a call nobody waits for any more finds none).
    pub fn on_response<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) -> Vec<Finished> {
        let Some(then) = self.calls.take(token) else {
            return Vec::new();
        };
        let answer = (num_headers, body_size);
        let mut finished = match then {
            Continuation::Delivery(attempt) => {
                let (calls, root) = (&mut self.calls, actor.acting_root());
                let done = self
                    .deliveries
                    .answered(host, calls, root, (attempt, token), answer);
                match done {
                    Some(finished) => vec![finished],
                    None => Vec::new(),
                }
            }
            Continuation::Claim => {
                let claimed = self.claims.answered(host, token, answer);
                self.send_parked(host, actor);
                self.continue_claims(host, actor, claimed)
            }
            Continuation::Settle => self.store_answered(host, actor, (token, false), answer),
            Continuation::Grant => self.store_answered(host, actor, (token, true), answer),
            Continuation::Export => {
                self.deliveries.export_answered(host, token);
                Vec::new()
            }
        };
        self.settle_ended(host, actor, &mut finished);
        finished
    }

    /// The settle stage for the fan-outs that ended holding claims since the last stage
    /// ran; then the etcd settles queued go out (if none is in flight). Adds to `finished`
    /// the answers that go out now: those whose claims are settled already (Envoy's store,
    /// async, no etcd settle), and those whose etcd settle failed at once. (Into the caller's
    /// list, and both checks in line: every call's answer passes here, and mostly nothing
    /// ended and nothing is queued.)
    #[inline]
    fn settle_ended<H: Host>(&mut self, host: &H, actor: Actor, finished: &mut Vec<Finished>) {
        if self.deliveries.has_ended() {
            self.queue_ended(host, actor, finished);
        }
        if self.etcd.ready_to_send() {
            self.flush_settles(host, actor, finished);
        }
    }

    /// Root context `root`'s timer: what is due in every fan-out, claim and settle.
    pub fn tick<H: Host>(&mut self, host: &H, root: u32) -> Vec<Finished> {
        let actor = Actor::Root(root);
        let mut finished = self.deliveries.tick(host, &mut self.calls, root);
        let claimed = self.claims.tick(host, &mut self.calls);
        finished.extend(self.continue_claims(host, actor, claimed));
        self.send_parked(host, actor);
        self.queue_ended(host, actor, &mut finished);
        finished.extend(self.tick_settles(host, actor));
        finished
    }

    /// Root context `root`'s timer, every tick: the etcd store's leases due.
    pub fn tick_leases<H: Host>(&mut self, host: &H, now_ms: u64, config: Option<&Config>) {
        remote::tick(host, &mut self.calls, now_ms, config, &mut self.etcd);
    }

    /// The spans of a new request on `channel`, if it is traced (`tracing`).
    pub fn traced<H: Host>(
        &mut self,
        host: &H,
        headers: &HeaderMap,
        event: Option<&ContentMode>,
        channel: &str,
        subscribers: usize,
    ) -> Option<Box<JobSpans>> {
        self.deliveries
            .traced(host, headers, event, channel, subscribers)
    }

    /// Root context `root` goes away: the spans held leave now.
    pub fn flush_spans<H: Host>(&mut self, host: &H, root: u32) {
        self.deliveries.export(host, &mut self.calls, root, true);
    }

    /// The stream of a request waiting for its claim ended (`ended`) or was answered by
    /// Envoy: nothing is claimed or called for it now. Whether it was not yet sent.
    pub fn forget<H: Host>(&mut self, host: &H, actor: Actor, ended: bool) -> bool {
        let Actor::Stream { id, .. } = actor else {
            return false;
        };
        let unsent = self.claims.forget(&mut self.calls, id, ended);
        // Its own claim txn forgotten, the claims parked meanwhile go out.
        self.send_parked(host, actor);
        unsent
    }

    /// Where the request of `stream`, handed to the pipeline to wait for its claim, is now:
    /// its sync fan-out under way (the job), or `None` (still claiming, or answered).
    pub fn job_of(&self, stream: u32) -> Option<u64> {
        self.deliveries.job_of(stream)
    }

    /// Whether the request of `stream` still waits for its claim (parked, in a claim txn,
    /// or failing).
    pub fn claiming(&self, stream: u32) -> bool {
        self.claims.holds(stream)
    }

    /// The sender of sync fan-out `job` went away (its stream is `actor`): its calls are
    /// cancelled and its claims settled. Returns whether it still waited for its answer.
    pub fn abandon<H: Host>(&mut self, host: &H, actor: Actor, job: u64) -> Vec<Finished> {
        self.deliveries.abandon(host, &mut self.calls, job);
        let mut finished = Vec::new();
        self.settle_ended(host, actor, &mut finished);
        finished
    }

    /// Whether job `id`'s sender still waits for its answer.
    pub fn awaits_answer(&self, id: u64) -> bool {
        self.deliveries.awaits_answer(id)
    }

    /// Whether a new event fits the worker: under `max_in_flight` if that bounds it, and its
    /// first calls in the capped clusters' lines (`max_queued_calls`); else its 503.
    pub fn admit<H: Host>(&mut self, host: &H, config: &Config, room: &Room) -> Result<(), Answer> {
        if room.in_flight {
            let in_flight = self.deliveries.async_in_flight();
            if in_flight >= config.max_in_flight {
                return Err(Answer::busy(in_flight));
            }
        }
        match &room.clusters {
            Some(clusters) => self.deliveries.admit(host, config, clusters),
            None => Ok(()),
        }
    }

    /// Everything this worker still owes.
    pub fn owed(&self) -> Owed {
        self.deliveries.owed(&self.calls)
    }

    /// Calls root context `root` made that are still in flight.
    pub fn open_calls_of(&self, root: u32) -> usize {
        self.calls.of_root(root)
    }

    /// Whether the root's timer has work soon: calls to send, retries, settles owed, claims
    /// to continue.
    pub fn has_timed_work(&self) -> bool {
        self.deliveries.has_timed_work() || self.etcd.owed() > 0 || self.claims.needs_tick()
    }

    /// Whether the etcd store wants the fast timer (settles owed, leases not held yet).
    pub fn store_wants_fast_timer(&self) -> bool {
        self.etcd.wants_fast_timer()
    }

    /// Sets root context `root`'s timer to `period` (the one place its period is decided;
    /// work queued meanwhile may quicken it).
    pub fn set_timer<H: Host>(&mut self, host: &H, root: u32, period: Duration) {
        self.timers.set(host, root, period);
    }

    /// Root context `root`'s timer period.
    pub fn timer(&self, root: u32) -> Duration {
        self.timers.period(root)
    }

    /// Root context `root` is gone.
    pub fn forget_root(&mut self, root: u32) {
        self.timers.forget(root);
    }

    /// The fan-out `job` of `stream`, continued after its claim (by the root, or by its own
    /// stream): started. A stream gone meanwhile (`gone`): an async fan-out goes on; a sync
    /// one is dropped as when its client leaves.
    fn launch<H: Host>(
        &mut self,
        host: &H,
        root: Option<u32>,
        (stream, gone): (u32, bool),
        job: Job,
    ) -> Vec<Finished> {
        let calls = &mut self.calls;
        let outcome = self.deliveries.launch(host, calls, root, job, stream);
        if !gone {
            return outcome.finished;
        }
        if let Some(id) = outcome.delivering {
            self.deliveries.abandon(host, calls, id);
        }
        Vec::new()
    }

    /// Sends the claims parked, if they can go (as one txn of `actor`'s root); one Envoy
    /// refused quickens the root's timer, which continues them as store errors.
    fn send_parked<H: Host>(&mut self, host: &H, actor: Actor) {
        let (calls, leases) = (&mut self.calls, &self.etcd.leases);
        if !self.claims.send_parked(host, calls, leases, actor.root()) {
            self.timers.hurry(host, actor.root(), remote::SETTLE_TICK);
        }
    }

    /// Continues each request the claim stage returned ([`Pipeline::continue_claim`]).
    fn continue_claims<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        claimed: Claimed<Job>,
    ) -> Vec<Finished> {
        let mut finished = Vec::new();
        for (pending, result) in claimed {
            finished.extend(self.continue_claim(host, actor, pending, result));
        }
        finished
    }

    /// The one continuation of a claim: etcd found what it found (the job's fan-out marked,
    /// its claims kept to settle) and the fan-out starts; or the store failed, and
    /// `on_store_error` decides: everyone is called, unrecorded, or the 503. What the stream
    /// must answer is returned (counted where it is sent).
    fn continue_claim<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        pending: Pending<Job>,
        result: Result<Found, StoreError>,
    ) -> Vec<Finished> {
        let Pending {
            stream,
            ask,
            mut job,
            sender_left,
            ..
        } = pending;
        let counter = self.counter(&job.config);
        match result {
            Ok(found) => {
                job.claims = dedupe_claim::claimed(host, &counter, ask, &found, &mut job.fanout)
            }
            Err(error) => {
                let now = job.started_ms;
                let etcd = &mut self.etcd;
                if error.lease_lost() {
                    etcd.leases.forget();
                }
                let failed =
                    dedupe_claim::store_failed(host, &counter, &job.config, stream, &error, || {
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

    fn counter(&self, config: &Config) -> Counter {
        Counter::new(config.metrics.then(|| self.telemetry.clone()))
    }
}
