//! One request's way through a worker once its recipients are chosen, as named stages, each
//! coded in one place:
//!
//! 1. **claim** (`claims.rs`): with `dedupe`'s etcd store, the event's claim is asked of etcd
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
//! Every entry point says which context runs ([`Actor`]): the calls made from a root
//! context's callbacks are the root's, those from a stream's the stream's (Envoy cancels them
//! when it ends).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use crate::answer::Answer;
use crate::cloudevents::ContentMode;
use crate::config::Config;
use crate::dedupe::claim::Claim;
use crate::dedupe::remote::{self, Remote};
use crate::deliveries::{Deliveries, Finished, Job, JobSpans, Launched, Owed};
use crate::headers::HeaderMap;
use crate::host::Host;
use crate::jitter::Jitter;
use crate::recipients::Room;
use crate::telemetry::{Counter, Telemetry};
use crate::timer::Timers;
pub use claims::Continued;
use claims::{Coalescer, Pending};

mod claims;
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

/// What [`Pipeline::begin`] made of a request: the answers to send now (its own among
/// them, if it is answered at once), and its sync fan-out under way, if that started.
#[derive(Default)]
pub struct Begun {
    pub finished: Vec<Finished>,
    pub delivering: Option<u64>,
}

/// Every request of one worker past its recipients: the claims, the deliveries, the
/// settles, the answers held for them. Shared by the VM's root contexts and their streams.
pub struct Pipeline {
    deliveries: Deliveries,
    /// The claim stage: claim txns in flight, requests parked, what the root made of them.
    claims: Coalescer,
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
            deliveries: Deliveries::new(telemetry.clone()),
            claims: Coalescer::default(),
            etcd: Remote::default(),
            held: Vec::new(),
            timers: Timers::default(),
            telemetry,
        }
    }

    /// A (new) configuration of root context `root`: the etcd store's lease kinds, the call
    /// caps, the retry jitter's seed.
    pub fn configure<H: Host>(&mut self, host: &H, config: &Config, root: u32) {
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
    /// ask (`claim`): straight to the deliveries, or into the claim stage. Claimed already,
    /// the stream learns at once what became of it ([`Begun`]); waiting for its claim, from
    /// the answers returned later and [`Pipeline::adopt`].
    pub fn begin<H: Host>(&mut self, host: &H, actor: Actor, mut job: Job, claim: Claim) -> Begun {
        let stream = job.log_id;
        let (mut finished, delivering) = match claim {
            Claim::Done(claims) => {
                job.claims = claims;
                let (finished, delivering) = self.start(host, actor.acting_root(), stream, job);
                (one(finished), delivering)
            }
            Claim::Ask(ask) => (self.claim(host, actor, Pending { stream, ask, job }), None),
        };
        self.settle_ended(host, actor, &mut finished);
        Begun {
            finished,
            delivering,
        }
    }

    /// The answer to call `token`, delivered to `actor`: a lease grant or settle txn of the
    /// etcd store, a claim txn, or a delivery's call.
    pub fn on_response<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) -> Vec<Finished> {
        let mut finished = match self.store_answered(host, actor, token, num_headers, body_size) {
            Some(finished) => finished,
            None => match self.claim_answered(host, actor, token, num_headers, body_size) {
                Some(finished) => finished,
                None => one(self.deliveries.on_response(
                    host,
                    actor.acting_root(),
                    token,
                    num_headers,
                    body_size,
                )),
            },
        };
        self.settle_ended(host, actor, &mut finished);
        finished
    }

    /// Root context `root`'s timer: what is due in every fan-out, claim and settle.
    pub fn tick<H: Host>(&mut self, host: &H, root: u32) -> Vec<Finished> {
        let actor = Actor::Root(root);
        let mut finished = self.deliveries.tick(host, root);
        finished.extend(self.tick_claims(host, actor));
        self.queue_ended(host, actor, &mut finished);
        finished.extend(self.tick_settles(host, actor));
        finished
    }

    /// Root context `root`'s timer, every tick: the etcd store's leases due.
    pub fn tick_leases<H: Host>(&mut self, host: &H, now_ms: u64, config: Option<&Config>) {
        remote::tick(host, now_ms, config, &mut self.etcd);
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
        self.deliveries.export(host, root, true);
    }

    /// What the root made of `stream`'s request while the stream waited for its claim, if it
    /// did (once).
    pub fn adopt(&mut self, stream: u32) -> Option<Continued> {
        self.claims.adopt(stream)
    }

    /// The stream of a request waiting for its claim ended (`ended`) or was answered by
    /// Envoy: nothing is claimed or called for it now. Whether it was not yet sent.
    pub fn forget<H: Host>(&mut self, host: &H, actor: Actor, ended: bool) -> bool {
        let Actor::Stream { id, .. } = actor else {
            return false;
        };
        let forgotten = self.claims.forget(id, ended);
        if let Some(token) = forgotten.cancelled {
            // Its own claim txn: Envoy cancels it with the stream; the claims parked
            // meanwhile go out.
            self.claims.landed(token);
            self.send_parked(host, actor);
        }
        forgotten.unsent
    }

    /// The sender of sync fan-out `job` went away (its stream is `actor`): its calls are
    /// cancelled and its claims settled. Returns whether it still waited for its answer.
    pub fn abandon<H: Host>(&mut self, host: &H, actor: Actor, job: u64) -> Vec<Finished> {
        self.deliveries.abandon(host, job);
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
        self.deliveries.owed()
    }

    /// Calls root context `root` made that are still in flight.
    pub fn open_calls_of(&self, root: u32) -> usize {
        self.deliveries.open_calls_of(root)
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
    /// stream): started, and what became of it kept for the stream. A stream gone meanwhile:
    /// an async fan-out goes on; a sync one is dropped as when its client leaves.
    fn launch<H: Host>(
        &mut self,
        host: &H,
        root: Option<u32>,
        stream: u32,
        job: Job,
    ) -> Option<Finished> {
        if self.claims.take_gone(stream) {
            if let Launched::Delivering(id, _) = self.deliveries.launch(host, root, job, stream) {
                self.deliveries.abandon(host, id);
            }
            return None;
        }
        let (finished, delivering) = self.start(host, root, stream, job);
        let what = delivering.map_or(Continued::Answered, Continued::Delivering);
        self.claims.continued(stream, what);
        finished
    }

    /// Hands the fan-out `job` of `stream` to the deliveries: its answer now (logged if it is
    /// a refusal), or a sync fan-out under way (its job), with its answer if it already
    /// ended.
    fn start<H: Host>(
        &mut self,
        host: &H,
        root: Option<u32>,
        stream: u32,
        job: Job,
    ) -> (Option<Finished>, Option<u64>) {
        match self.deliveries.launch(host, root, job, stream) {
            Launched::Answer(answer) => (Some(answer_now(stream, answer)), None),
            Launched::Delivering(id, finished) => (finished, Some(id)),
        }
    }

    fn counter(&self, config: &Config) -> Counter {
        Counter::new(config.metrics.then(|| self.telemetry.clone()))
    }
}

/// `stream` is answered at once (logged if it is a refusal; counted where it is sent).
fn answer_now(stream: u32, answer: Answer) -> Finished {
    if answer.status >= 400 {
        log::info!(
            "[#{stream}] answered {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
    }
    Finished {
        answer_to: Some(stream),
        answer,
    }
}

/// The answer list of an entry point that has at most one answer of its own (no allocation
/// when it has none, as for most calls' answers).
#[inline]
fn one(finished: Option<Finished>) -> Vec<Finished> {
    match finished {
        Some(finished) => vec![finished],
        None => Vec::new(),
    }
}
