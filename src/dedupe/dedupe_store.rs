//! The one face dedupe's stores show the pipeline ([`DedupeStore`]): the pipeline's stages
//! call it and never know which store is behind it (Envoy's shared data, `stores.rs`; etcd,
//! `etcd/store.rs`).
//!
//! A store that calls out enters the call's token in the worker's call table, and its answer
//! comes back through [`DedupeStore::answer`]; what a store hands back is only what the
//! pipeline continues: requests claimed (with what the store found, or its failure) and
//! answers it no longer holds. The store decides nothing about the deliveries.

use crate::answer::Answer;
use crate::call_table::{CallTable, Continuation};
use crate::config::Config;
use crate::fan_out_state::FanOut;
use crate::host::Host;
use crate::telemetry::Counter;
use crate::timer::Timers;

use super::claim::Ask;
pub use super::etcd::claims::{Claimed, Pending};
pub use super::etcd::{Found, StoreError};
use super::settle::Claims;

/// The context a store runs in: the worker's call table, the root contexts' timers, and the
/// root whose calls the store's are (the acting one, or the stream's).
pub struct Acting<'a> {
    pub calls: &'a mut CallTable,
    pub timers: &'a mut Timers,
    pub root: u32,
}

/// A sync sender's answer a store may hold until its settle is written.
pub trait HeldAnswer {
    /// Whether a sender waits for it (a sync fan-out's): only such an answer is held.
    fn waits(&self) -> bool;
    /// The answer, marked as not recorded in the store (its settle failed).
    fn not_recorded(self) -> Self;
}

/// A fan-out that ended holding claims: what its settle needs, and its answer (`A`).
pub struct Ending<'a, A> {
    pub job: u64,
    pub config: &'a Config,
    pub counter: &'a Counter,
    pub claims: Claims,
    /// Whether each subscriber (by index in the channel) has the event.
    pub delivered: &'a [bool],
    pub log_id: u32,
    /// When it ended, on the host's clock.
    pub now_ms: u64,
    pub answer: Option<A>,
}

/// What a store's call answered, or its timer, hands back: requests to continue with their
/// claims, and answers let go.
pub struct Answered<J, A> {
    pub claimed: Claimed<J>,
    pub released: Vec<A>,
}

impl<J, A> Default for Answered<J, A> {
    fn default() -> Self {
        Answered {
            claimed: Vec::new(),
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

/// A request's claim, answered: what [`DedupeStore::decide`] decides on.
pub struct Deciding<'a> {
    pub counter: &'a Counter,
    pub config: &'a Config,
    /// The request's context id (for log lines) and its start.
    pub log_id: u32,
    pub now_ms: u64,
    pub ask: Ask,
    /// What the store found, or its failure.
    pub result: Result<Found, StoreError>,
}

/// What a request's claim came to, once its store answered ([`DedupeStore::decide`]).
pub enum Decided {
    /// Claimed (its fan-out marked): the claims to settle when the fan-out ends, if any.
    Claims(Option<Claims>),
    /// The store failed, and `on_store_error: deliver`: everyone is called, unrecorded.
    Unrecorded,
    /// The store failed, and `on_store_error: reject`: this answer, nobody called.
    Refused(Answer),
}

/// A dedupe store, as the pipeline's stages use it: `J` is a request's fan-out waiting for
/// its claim, `A` a sender's answer.
pub trait DedupeStore<J, A: HeldAnswer> {
    /// A (new) configuration: the store made ready.
    fn configure<H: Host>(&mut self, host: &H, config: &Config);

    /// The claim stage: a request whose claim the store must be asked; what is claimed (or
    /// failed) now, to continue; the rest comes back through [`DedupeStore::answer`].
    fn claim<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, pending: Pending<J>) -> Claimed<J>;

    /// The answer to the store's call `call`.
    fn answer<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, call: StoreCall)
        -> Answered<J, A>;

    /// The settle stage, for one fan-out that ended: its answer, unless the store holds it
    /// until the settle is written.
    fn settle<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        ending: Ending<'_, A>,
    ) -> Option<A>;

    /// Whether settles are owed that can go out now ([`DedupeStore::send`]).
    fn ready_to_send(&self) -> bool;

    /// The settles owed go out now; the answers of those that failed at once.
    fn send<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Vec<A>;

    /// The root's timer: calls overdue and claims that could not go out, as store errors.
    fn tick<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Answered<J, A>;

    /// The root's timer, after the stages ran: whatever the store owes goes out.
    fn send_owed<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Vec<A>;

    /// The root's timer, every tick (the root is the current context): what the store keeps
    /// ahead of need (etcd's leases).
    fn keep_ahead<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        now_ms: u64,
        config: Option<&Config>,
    );

    /// The stream of a request waiting for its claim ended (`ended`) or was answered by
    /// Envoy: nothing is claimed for it now. Whether its claim was not yet sent.
    fn forget<H: Host>(&mut self, host: &H, at: &mut Acting<'_>, stream: u32, ended: bool) -> bool;

    /// Whether the request of `stream` still waits for its claim.
    fn claiming(&self, stream: u32) -> bool;

    /// A request's claim answered: what the store found marked in `fanout` and the claims
    /// to settle, or its failure counted, logged, and decided by `on_store_error`.
    fn decide<H: Host>(&mut self, host: &H, claim: Deciding<'_>, fanout: &mut FanOut) -> Decided;

    /// Whether the root's timer has the store's work soon (settles owed, claims to
    /// continue).
    fn has_timed_work(&self) -> bool;

    /// Whether the store wants the fast timer (settles owed, leases not held yet).
    fn wants_fast_timer(&self) -> bool;
}
