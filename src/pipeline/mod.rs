//! One request's way through a worker once its recipients are chosen, as named stages, each
//! coded in one place:
//!
//! 1. **claim**: with `dedupe`'s etcd store, the event's claim is asked of the store first
//!    ([`DedupeStore::claim`]), and its answer (or the store's failure) decides who is called
//!    (`Pipeline::continue_claim`);
//! 2. **deliver** ([`Deliveries`]): the calls, their retries, the verdict;
//! 3. **settle**: when the fan-out ends, its claims are settled by the store they are in
//!    ([`DedupeStore::settle`]: in Envoy's shared data at once; in etcd as a txn of the root
//!    context);
//! 4. **answer**: the sender's answer goes out, a sync one with the etcd store only once etcd
//!    has its settle (the store holds it until then). The pipeline never answers a sender
//!    itself: it returns each answer ([`Finished`]) to the context that runs, which sends it
//!    (no `RefCell` borrowed while Envoy runs the local reply).
//!
//! The pipeline never knows which store is behind [`DedupeStore`] (`dedupe/stores.rs`).
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
use crate::config::Channel;
use crate::config::Config;
use crate::dedupe::claim::Claim;
use crate::dedupe::dedupe_store::{Acting, Claimant, Decided, Decision, DedupeStore};
use crate::dedupe::dedupe_store::{HeldAnswer, Pending, StoreCall};
use crate::dedupe::settle::NOT_RECORDED_HEADER;
use crate::dedupe::stores::Stores;
use crate::deliveries::{Deliveries, Finished, Job, JobSpans, Outcome, Owed};
use crate::fan_out_state::FanOut;
use crate::headers::HeaderMap;
use crate::host::Host;
use crate::jitter::Jitter;
use crate::recipients::Room;
use crate::telemetry::Telemetry;
use crate::timer::Timers;

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
    /// `dedupe`'s stores: the claims to ask, the settles, the answers held for them.
    store: Stores<Job, Finished>,
    /// The root contexts' timers.
    timers: Timers,
}

impl Pipeline {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        Pipeline {
            calls: CallTable::default(),
            deliveries: Deliveries::new(telemetry.clone()),
            store: Stores::new(telemetry),
            timers: Timers::default(),
        }
    }

    /// A (new) configuration of root context `root`: `dedupe`'s store (the shard keys
    /// created in Envoy's shared data, or the etcd store's lease kinds), the call caps, the
    /// tracing, the retry jitter's seed.
    pub fn configure<H: Host>(&mut self, host: &H, config: &Config, root: u32) {
        self.store.configure(host, config);
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

    /// The request of stream `actor`, its recipients chosen (`job`) and its claims to make
    /// (`claim`; `None`: nothing to claim): into the claim stage, then the deliveries. What
    /// it made of the request ([`Outcome`]): a sync fan-out under way, the answers due now;
    /// waiting for its claim, neither (the claim's answer continues it).
    pub fn begin<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        job: Job,
        claim: Option<Claim>,
    ) -> Outcome {
        let stream = job.log_id;
        let mut outcome = match claim {
            None => {
                let root = actor.acting_root();
                self.deliveries
                    .launch(host, &mut self.calls, root, job, stream)
            }
            Some(claim) => {
                let pending = Pending::new(stream, claim, job.started_ms, job);
                let mut at = acting(&mut self.calls, &mut self.timers, actor);
                let decided = self.store.claim(host, &mut at, pending);
                self.continue_decided(host, actor, decided)
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
            Continuation::Export => {
                self.deliveries.export_answered(host, token);
                Vec::new()
            }
            store_call => {
                let mut at = acting(&mut self.calls, &mut self.timers, actor);
                let call = StoreCall {
                    token,
                    then: store_call,
                    reply: answer,
                };
                let answered = self.store.answer(host, &mut at, call);
                let mut finished = self
                    .continue_decided(host, actor, answered.decided)
                    .finished;
                finished.extend(answered.released);
                finished
            }
        };
        self.settle_ended(host, actor, &mut finished);
        finished
    }

    /// The settle stage, for the fan-outs that ended holding claims since it last ran: the
    /// store settles them (and may hold a sync sender's answer until its settle is written);
    /// adds the answers that go out now to `finished`. (Into the caller's list, and the check
    /// in line: every call's answer passes here, and mostly nothing ended.)
    #[inline(always)]
    fn settle_ended<H: Host>(&mut self, host: &H, actor: Actor, finished: &mut Vec<Finished>) {
        if self.deliveries.has_ended() {
            let ended = self.deliveries.take_ended();
            let mut at = acting(&mut self.calls, &mut self.timers, actor);
            finished.extend(self.store.settle(host, &mut at, ended));
        }
    }

    /// Root context `root`'s timer (`config`: its configuration): what is due in every
    /// fan-out, claim and settle, and what the store keeps ahead.
    pub fn tick<H: Host>(&mut self, host: &H, root: u32, config: Option<&Config>) -> Vec<Finished> {
        let actor = Actor::Root(root);
        let mut finished = self.deliveries.tick(host, &mut self.calls, root);
        self.settle_ended(host, actor, &mut finished);
        let mut at = acting(&mut self.calls, &mut self.timers, actor);
        let ticked = self.store.tick(host, &mut at, config);
        finished.extend(ticked.released);
        finished.extend(self.continue_decided(host, actor, ticked.decided).finished);
        finished
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
        let mut at = acting(&mut self.calls, &mut self.timers, actor);
        self.store.forget(host, &mut at, id, ended)
    }

    /// Where the request of `stream`, handed to the pipeline to wait for its claim, is now:
    /// its sync fan-out under way (the job), or `None` (still claiming, or answered).
    pub fn job_of(&self, stream: u32) -> Option<u64> {
        self.deliveries.job_of(stream)
    }

    /// Whether the request of `stream` still waits for its claim (parked, in a claim txn,
    /// or failing).
    pub fn claiming(&self, stream: u32) -> bool {
        self.store.claiming(stream)
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

    /// The period the timer of a root configured with `config` needs for the worker's
    /// deliveries and store (`None`: none): [`DELIVERY_TICK`] while calls are to send or
    /// retry (or the configuration has async or best-effort deliveries), else the store's.
    pub fn timer_needed(&self, config: Option<&Config>) -> Option<Duration> {
        let delivering = self.deliveries.has_timed_work() || config.is_some_and(|c| c.needs_timer);
        let store = self.store.timer(config);
        match (delivering.then_some(DELIVERY_TICK), store) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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
    ) -> Outcome {
        let calls = &mut self.calls;
        let outcome = self.deliveries.launch(host, calls, root, job, stream);
        if !gone {
            return outcome;
        }
        if let Some(id) = outcome.delivering {
            self.deliveries.abandon(host, calls, id);
        }
        Outcome::default()
    }

    /// Continues each request whose claim its store decided: its fan-out starts (from the
    /// acting context), or its answer is returned (counted where it is sent). What it made
    /// of them ([`Outcome`]: one request's sync fan-out under way, when it continues in its
    /// own stream).
    fn continue_decided<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        decided: Vec<Decision<Job>>,
    ) -> Outcome {
        let mut outcome = Outcome::default();
        for Decision {
            stream,
            mut job,
            sender_left,
            decided,
        } in decided
        {
            match decided {
                Decided::Claims(claims) => job.claims = claims,
                Decided::Unrecorded => job.unrecorded = true,
                Decided::Refused(_) if sender_left => continue,
                Decided::Refused(answer) => {
                    outcome.finished.push(Finished::now(stream, answer));
                    continue;
                }
            }
            let launched = self.launch(host, actor.acting_root(), (stream, sender_left), job);
            outcome.delivering = outcome.delivering.or(launched.delivering);
            outcome.finished.extend(launched.finished);
        }
        outcome
    }
}

/// The root context's timer while deliveries need it (retries, async, best-effort): the
/// resolution of backoff delays, and the most an async event waits before its calls go out.
pub const DELIVERY_TICK: Duration = Duration::from_millis(10);

/// The store's context for a call from `actor`: the calls it makes are its root's.
fn acting<'a>(calls: &'a mut CallTable, timers: &'a mut Timers, actor: Actor) -> Acting<'a> {
    Acting {
        calls,
        timers,
        root: actor.root(),
    }
}

impl Claimant for Job {
    fn claimant(&mut self) -> (&Config, &Channel, &mut FanOut) {
        (&self.config, &self.channel, &mut self.fanout)
    }
}

impl HeldAnswer for Finished {
    fn waits(&self) -> bool {
        self.answer_to.is_some()
    }

    fn not_recorded(mut self) -> Finished {
        self.answer = self.answer.with_header(NOT_RECORDED_HEADER, "1".into());
        self
    }
}
