//! The stores behind [`DedupeStore`], as one: the `envoy` store ([`ShardStore`]: Envoy's
//! shared data, claimed before the pipeline, settled at once) and the `etcd` store
//! ([`EtcdAgent`]). [`Stores`] hands each call to the store it concerns: a fan-out's settle to
//! the store its claims are in (a new configuration may have changed the store meanwhile),
//! the rest to the etcd store, the only one that calls out.

use std::cell::RefCell;
use std::rc::Rc;

use super::dedupe_store::{Acting, Answered, Decided, Deciding, DedupeStore, Ending};
use super::dedupe_store::{HeldAnswer, StoreCall};
use super::etcd::claims::{Claimed, Pending};
use super::etcd::store::EtcdAgent;
use super::settle::{self, Claims};
use crate::call_table::CallTable;
use crate::config::Config;
use crate::fan_out_state::FanOut;
use crate::host::Host;
use crate::telemetry::Telemetry;

/// The `envoy` store: the shard keys of Envoy's shared data. Its claims are made before the
/// pipeline (they need no call); its settles are written at once.
#[derive(Default)]
pub struct ShardStore;

impl ShardStore {
    /// At configure time: the shard keys created.
    fn configure<H: Host>(&mut self, host: &H, config: &Config) {
        settle::prepare(host, config);
    }

    /// A fan-out's claims in a shard, settled now; its answer goes out.
    fn settle<H: Host, A>(&mut self, host: &H, ending: Ending<'_, A>) -> Option<A> {
        if let Claims::Shard(held) = ending.claims {
            let settled = settle::settle_shard(
                host,
                ending.now_ms,
                ending.config,
                held,
                ending.delivered,
                ending.log_id,
            );
            ending.counter.count(host, |tally| settled.record(tally));
        }
        ending.answer
    }
}

/// Every store of a worker, behind one [`DedupeStore`].
pub struct Stores<J, A> {
    shard: ShardStore,
    etcd: EtcdAgent<J, A>,
}

impl<J, A> Stores<J, A> {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        Stores {
            shard: ShardStore,
            etcd: EtcdAgent::new(telemetry),
        }
    }
}

impl<J, A: HeldAnswer> DedupeStore<J, A> for Stores<J, A> {
    fn configure<H: Host>(&mut self, host: &H, config: &Config) {
        self.shard.configure(host, config);
        self.etcd.configure(host, config);
    }

    fn claim<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, pending: Pending<J>) -> Claimed<J> {
        self.etcd.claim(host, at, pending)
    }

    fn answer<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        call: StoreCall,
    ) -> Answered<J, A> {
        self.etcd.answer(host, at, call)
    }

    fn settle<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        ending: Ending<'_, A>,
    ) -> Option<A> {
        match ending.claims {
            Claims::Shard(_) => self.shard.settle(host, ending),
            Claims::Etcd(_) => self.etcd.settle(host, at, ending),
        }
    }

    #[inline]
    fn ready_to_send(&self) -> bool {
        self.etcd.ready_to_send()
    }

    fn send<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Vec<A> {
        self.etcd.send(host, at)
    }

    fn tick<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Answered<J, A> {
        self.etcd.tick(host, at)
    }

    fn send_owed<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Vec<A> {
        self.etcd.send_owed(host, at)
    }

    fn keep_ahead<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        now_ms: u64,
        config: Option<&Config>,
    ) {
        self.etcd.keep_ahead(host, calls, now_ms, config);
    }

    fn forget<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, stream: u32, ended: bool) -> bool {
        self.etcd.forget(host, at, stream, ended)
    }

    fn claiming(&self, stream: u32) -> bool {
        self.etcd.claiming(stream)
    }

    fn decide<H: Host>(&mut self, host: &H, claim: Deciding<'_>, fanout: &mut FanOut) -> Decided {
        self.etcd.decide(host, claim, fanout)
    }

    fn has_timed_work(&self) -> bool {
        self.etcd.has_timed_work()
    }

    fn wants_fast_timer(&self) -> bool {
        self.etcd.wants_fast_timer()
    }
}
