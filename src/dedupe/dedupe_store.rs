//! The one face dedupe's stores show the pipeline ([`DedupeStore`]): the pipeline's stages
//! call it and never know which store is behind it (Envoy's shared data, `stores.rs`; etcd,
//! `etcd/store.rs`).
//!
//! A store that calls out enters the call's token in the worker's call table, and its answer
//! comes back through [`DedupeStore::answer`]; what a store hands back is only what the
//! pipeline continues: requests whose claim is decided ([`Decision`]) and answers it no
//! longer holds. The store decides nothing about the deliveries.

use std::rc::Rc;
use std::time::Duration;

use crate::answer::Answer;
use crate::call_table::{CallTable, Continuation};
use crate::config::{Channel, Config};
use crate::fan_out_state::FanOut;
use crate::host::Host;
use crate::timer::Timers;

use super::claim::Claim;
use super::settle::Claims;

/// The context a store runs in: the worker's call table, the root contexts' timers, and the
/// root whose calls the store's are (the acting one, or the stream's).
pub struct Acting<'a> {
    pub calls: &'a mut CallTable,
    pub timers: &'a mut Timers,
    pub root: u32,
}

/// A request's fan-out waiting for its claim, as a store sees it: the configuration it
/// started with, its channel, and the fan-out its claim marks.
pub trait Claimant {
    /// Its configuration, its channel, and its fan-out to mark.
    fn claimant(&mut self) -> (&Config, &Channel, &mut FanOut);
}

/// A sync sender's answer a store may hold until its settle is written.
pub trait HeldAnswer {
    /// Whether a sender waits for it (a sync fan-out's): only such an answer is held.
    fn waits(&self) -> bool;
    /// The answer, marked as not recorded in the store (its settle failed).
    fn not_recorded(self) -> Self;
}

/// A request waiting for its claim: its stream, its claim (`K`: which store and what to
/// ask), when it started (the claims' time), and its fan-out (`J`, the pipeline's), ready to
/// start once claimed.
pub struct Pending<J, K = Claim> {
    pub stream: u32,
    pub ask: K,
    pub started_ms: u64,
    pub job: J,
    /// Its stream ended (or Envoy answered it) while its claim was in a txn in flight:
    /// nobody to answer.
    pub sender_left: bool,
}

impl<J, K> Pending<J, K> {
    pub fn new(stream: u32, ask: K, started_ms: u64, job: J) -> Pending<J, K> {
        Pending {
            stream,
            ask,
            started_ms,
            job,
            sender_left: false,
        }
    }

    /// The same request, with its claim `ask` (the store's own part of it).
    pub fn with_ask<L>(self, ask: L) -> Pending<J, L> {
        Pending {
            stream: self.stream,
            ask,
            started_ms: self.started_ms,
            job: self.job,
            sender_left: self.sender_left,
        }
    }

    /// Its claim taken out, to hand to its store ([`Pending::with_ask`]).
    pub fn take_ask(self) -> (K, Pending<J, ()>) {
        let ask = self.ask;
        let rest = Pending {
            stream: self.stream,
            ask: (),
            started_ms: self.started_ms,
            job: self.job,
            sender_left: self.sender_left,
        };
        (ask, rest)
    }
}

/// What a request's claim came to, once its store decided.
pub enum Decided {
    /// Claimed (its fan-out marked): the claims to settle when the fan-out ends, if any.
    Claims(Option<Claims>),
    /// The store failed, and `on_store_error: deliver`: everyone is called, unrecorded.
    Unrecorded,
    /// The store failed, and `on_store_error: reject`: this answer, nobody called.
    Refused(Answer),
}

/// A request whose claim is decided, for the pipeline to continue (launched, or answered
/// now).
pub struct Decision<J> {
    pub stream: u32,
    pub job: J,
    /// Nobody waits for its answer any more.
    pub sender_left: bool,
    pub decided: Decided,
}

/// A fan-out that ended holding claims: what its settle needs, and its sender's answer
/// (`A`; `None`: async, answered already, or abandoned), which the store may hold until the
/// claims are settled.
pub struct Ending<A> {
    pub job: u64,
    pub config: Rc<Config>,
    pub claims: Claims,
    /// Whether each subscriber (by index in the channel) has the event.
    pub delivered: Vec<bool>,
    pub log_id: u32,
    /// When it ended, on the host's clock.
    pub now_ms: u64,
    pub answer: Option<A>,
}

/// What a store hands back from a call's answer or its timer: requests whose claim is
/// decided, and answers let go.
pub struct Answered<J, A> {
    pub decided: Vec<Decision<J>>,
    pub released: Vec<A>,
}

impl<J, A> Default for Answered<J, A> {
    fn default() -> Self {
        Answered {
            decided: Vec::new(),
            released: Vec::new(),
        }
    }
}

/// The answer to one of a store's calls: its token, its continuation, and the answer's
/// header count and body size.
pub struct StoreCall {
    pub token: u32,
    pub then: Continuation,
    pub reply: (usize, usize),
}

/// A dedupe store, as the pipeline's stages use it: `J` is a request's fan-out waiting for
/// its claim, `A` a sender's answer.
pub trait DedupeStore<J: Claimant, A: HeldAnswer> {
    /// A (new) configuration: the store made ready.
    fn configure<H: Host>(&mut self, host: &H, config: &Config);

    /// The claim stage: the request `pending`'s claims. What is decided now, to continue
    /// (its fan-out marked); the rest comes back through [`DedupeStore::answer`] or
    /// [`DedupeStore::tick`].
    fn claim<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        pending: Pending<J>,
    ) -> Vec<Decision<J>>;

    /// The answer to the store's call `call`.
    fn answer<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, call: StoreCall)
        -> Answered<J, A>;

    /// The settle stage, for the fan-outs that ended holding claims: the answers that go out
    /// now (the store may hold a sync sender's until its settle is written).
    fn settle<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, ended: Vec<Ending<A>>) -> Vec<A>;

    /// The root's timer (the root is the current context; `config` its configuration): calls
    /// overdue and claims that could not go out, as store errors; whatever the store owes
    /// goes out; what it keeps ahead of need (etcd's leases).
    fn tick<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        config: Option<&Config>,
    ) -> Answered<J, A>;

    /// The stream of a request waiting for its claim ended (`ended`) or was answered by
    /// Envoy: nothing is claimed for it now. Whether its claim was not yet sent.
    fn forget<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, stream: u32, ended: bool) -> bool;

    /// Whether the request of `stream` still waits for its claim.
    fn claiming(&self, stream: u32) -> bool;

    /// The period the timer of a root configured with `config` needs for the store (`None`:
    /// none): fast while it owes something, slow enough to keep its leases ahead otherwise.
    fn timer(&self, config: Option<&Config>) -> Option<Duration>;
}
