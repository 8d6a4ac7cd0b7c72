//! The stores behind [`DedupeStore`], as one: the `envoy` store ([`ShardStore`]: Envoy's
//! shared data, claimed and settled at once, no call) and the `etcd` store ([`EtcdAgent`]).
//! [`Stores`] hands each request's claim to the store its configuration names, and a
//! fan-out's settle to the store its claims are in (a new configuration may have changed the
//! store meanwhile); the calls, the timer and the requests waiting for their claim are the
//! etcd store's, the only one that calls out.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use super::claim::{self, Claim, ShardAsk};
use super::dedupe_store::{Acting, Answered, Claimant, Decided, Decision, DedupeStore, Ending};
use super::dedupe_store::{HeldAnswer, Pending, StoreCall};
use super::etcd::store::EtcdAgent;
use super::settle::{self, Claims};
use crate::config::Config;
use crate::host::Host;
use crate::telemetry::{Counter, Telemetry};

/// The `envoy` store: the shard keys of Envoy's shared data. Its claims and settles are
/// written at once (no call).
#[derive(Default)]
pub struct ShardStore;

impl ShardStore {
    /// At configure time: the shard keys created.
    fn configure<H: Host>(&mut self, host: &H, config: &Config) {
        settle::prepare(host, config);
    }

    /// The claims of a request in the event's shard, made now: its fan-out marked.
    fn claim<H: Host, J: Claimant>(
        &mut self,
        host: &H,
        counter: impl Fn(&Config) -> Counter,
        pending: Pending<J, ShardAsk>,
    ) -> Decision<J> {
        let Pending {
            stream,
            ask,
            mut job,
            sender_left,
            ..
        } = pending;
        let (config, channel, fanout) = job.claimant();
        let claims = config.dedupe.as_ref().and_then(|dedupe| {
            let counter = counter(config);
            claim::claim_in_shard(host, &counter, (dedupe, channel), stream, ask, fanout)
        });
        Decision {
            stream,
            job,
            sender_left,
            decided: Decided::Claims(claims),
        }
    }

    /// A fan-out's claims in a shard, settled now; its answer goes out.
    fn settle<H: Host, A>(&mut self, host: &H, counter: &Counter, ending: Ending<A>) -> Option<A> {
        if let Claims::Shard(held) = ending.claims {
            let settled = settle::settle_shard(
                host,
                ending.now_ms,
                &ending.config,
                held,
                &ending.delivered,
                ending.log_id,
            );
            counter.count(host, |tally| settled.record(tally));
        }
        ending.answer
    }
}

/// Every store of a worker, behind one [`DedupeStore`].
pub struct Stores<J, A> {
    shard: ShardStore,
    etcd: EtcdAgent<J, A>,
    telemetry: Rc<RefCell<Telemetry>>,
}

impl<J, A> Stores<J, A> {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        Stores {
            shard: ShardStore,
            etcd: EtcdAgent::new(telemetry.clone()),
            telemetry,
        }
    }
}

/// How a request with `config` counts.
fn counter(telemetry: &Rc<RefCell<Telemetry>>, config: &Config) -> Counter {
    Counter::new(config.metrics.then(|| telemetry.clone()))
}

impl<J: Claimant, A: HeldAnswer> DedupeStore<J, A> for Stores<J, A> {
    fn configure<H: Host>(&mut self, host: &H, config: &Config) {
        self.shard.configure(host, config);
        self.etcd.configure(config);
    }

    fn claim<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        pending: Pending<J>,
    ) -> Vec<Decision<J>> {
        let (ask, pending) = pending.take_ask();
        match ask {
            Claim::Shard(ask) => {
                let telemetry = &self.telemetry;
                let counter = |config: &Config| counter(telemetry, config);
                vec![self.shard.claim(host, counter, pending.with_ask(ask))]
            }
            Claim::Etcd(ask) => self.etcd.claim(host, at, pending.with_ask(ask)),
        }
    }

    fn answer<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        call: StoreCall,
    ) -> Answered<J, A> {
        self.etcd.answer(host, at, call)
    }

    fn settle<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, ended: Vec<Ending<A>>) -> Vec<A> {
        let mut answers = Vec::new();
        for ending in ended {
            let counter = counter(&self.telemetry, &ending.config);
            let answer = match ending.claims {
                Claims::Shard(_) => self.shard.settle(host, &counter, ending),
                Claims::Etcd(_) => self.etcd.settle(host, at, &counter, ending),
            };
            answers.extend(answer);
        }
        answers.extend(self.etcd.send(host, at));
        answers
    }

    fn tick<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        config: Option<&Config>,
    ) -> Answered<J, A> {
        self.etcd.tick(host, at, config)
    }

    fn forget<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, stream: u32, ended: bool) -> bool {
        self.etcd.forget(host, at, stream, ended)
    }

    fn claiming(&self, stream: u32) -> bool {
        self.etcd.claiming(stream)
    }

    fn timer(&self, config: Option<&Config>) -> Option<Duration> {
        self.etcd.timer(config)
    }
}
