//! The etcd store behind `DedupeStore` (`dedupe/stores.rs` hands it on): the claim stage's
//! coalescer ([`Coalescer`]), the VM's leases and settles ([`Remote`]), and the answers held
//! for their settles.
//!
//! With the etcd store, a sync fan-out that claimed in etcd is answered only once its settle
//! is answered, so that when its sender hears the answer what it delivered is in etcd (a
//! redelivery through any replica, this one dead or alive, calls only the subscribers without
//! a record). The settles are calls of a root context (Envoy cancels a stream's calls when
//! the stream ends); the answer goes to the stream from there, as a parked request's does.
//!
//! A settle that fails (etcd unreachable, no lease for the records, no answer) is a store
//! error: counted, logged (at most once per 10 s), and the answer held for it goes out as the
//! fan-out decided it, marked not recorded ([`HeldAnswer::not_recorded`]): a `202` stays a
//! `202` (every subscriber has the event; an error would make the sender redeliver it to all
//! of them), a `500` stays a `500` (the sender must redeliver; the subscribers that took it
//! may be called again).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use super::claims::{Claimed, Coalescer};
use super::remote::{self, Remote, Sent};
use super::{Found, StoreError};
use crate::call_table::Continuation;
use crate::config::{Config, Store};
use crate::dedupe::claim::{claimed, etcd_reply, store_failed, Ask};
use crate::dedupe::dedupe_store::{Acting, Answered, Claimant, Decided, Decision, Ending};
use crate::dedupe::dedupe_store::{HeldAnswer, Pending, StoreCall};
use crate::dedupe::settle::{self, Claims, RemoteSettle};
use crate::host::Host;
use crate::telemetry::{count_into, Counter, Telemetry};

/// The etcd store's side of one worker. `J`: a request's fan-out waiting for its claim; `A`:
/// a sender's answer.
pub struct EtcdAgent<J, A> {
    /// The claim stage: claim txns in flight, requests parked.
    claims: Coalescer<J>,
    /// The leases, settles queued and in flight, warnings.
    remote: Remote,
    /// Sync fan-outs ended whose answer waits for their settle (job id, answer).
    held: Vec<(u64, A)>,
    telemetry: Rc<RefCell<Telemetry>>,
}

impl<J, A> EtcdAgent<J, A> {
    pub fn new(telemetry: Rc<RefCell<Telemetry>>) -> Self {
        EtcdAgent {
            claims: Coalescer::default(),
            remote: Remote::default(),
            held: Vec::new(),
            telemetry,
        }
    }
}

impl<J, A: HeldAnswer> EtcdAgent<J, A> {
    /// Sends the claims parked, if they can go (as one txn of the acting root); one Envoy
    /// refused quickens the root's timer, which continues them as store errors.
    fn send_parked<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) {
        let (calls, leases) = (&mut *at.calls, &self.remote.leases);
        if !self.claims.send_parked(host, calls, leases, at.root) {
            at.timers.hurry(host, at.root, remote::SETTLE_TICK);
        }
    }

    /// An etcd settle owed: sent at the next tick of the acting root, quickened for it.
    fn queue<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        counter: &Counter,
        settle: RemoteSettle,
    ) {
        self.remote.queue(settle);
        at.timers.hurry(host, at.root, remote::SETTLE_TICK);
        counter.count(host, |tally| tally.owed(1));
    }

    fn send_settles<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Vec<A> {
        let now = host.now_ms();
        let failed = self.remote.send_settles(host, at.calls, now, at.root);
        self.settles_ended(host, &failed, true)
    }

    /// The continuation of the store's calls of a root: lease grant `token` (`grant`; the
    /// lease is held, or asked again later) or settle txn `token` (the answers it held go
    /// out); then the settles queued since and the claims waiting go out.
    fn store_answered<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        (token, grant): (u32, bool),
        (num_headers, body_size): (usize, usize),
    ) -> Vec<A> {
        let reply = || etcd_reply(host, num_headers, body_size);
        let mut released = Vec::new();
        if grant {
            self.remote.grant_answered(token, reply, || host.now_ms());
        } else if let Some((settles, failed)) =
            self.remote.settle_answered(token, reply, || host.now_ms())
        {
            released = self.settles_ended(host, &settles, failed);
        }
        if self.remote.ready_to_send() {
            released.extend(self.send_settles(host, at));
        }
        self.send_parked(host, at);
        released
    }

    /// `settles` ended, applied or (`failed`) not: counted, and the answers they held let go.
    fn settles_ended<H: Host>(&mut self, host: &H, settles: &[Sent], failed: bool) -> Vec<A> {
        let counted = settles.iter().filter(|s| s.metrics).count() as u64;
        if counted > 0 {
            count_into(&self.telemetry, host, |tally| {
                tally.owed(-(counted as i64));
                if failed {
                    tally.dedupe_store_errors(counted);
                }
            });
        }
        let mut released = Vec::new();
        for job in settles.iter().filter_map(|s| s.hold) {
            let Some(at) = self.held.iter().position(|(id, _)| *id == job) else {
                continue;
            };
            let (_, done) = self.held.swap_remove(at);
            released.push(if failed { done.not_recorded() } else { done });
        }
        released
    }
}

/// The etcd store's part of [`crate::dedupe::dedupe_store::DedupeStore`], as `Stores` hands
/// it on.
impl<J: Claimant, A: HeldAnswer> EtcdAgent<J, A> {
    pub fn configure(&mut self, config: &Config) {
        remote::prepare(&mut self.remote, config);
    }

    /// The claim stage: the claim goes out (or is parked); a claim Envoy refused to send is
    /// decided now, as a store error.
    pub fn claim<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        pending: Pending<J, Ask>,
    ) -> Vec<Decision<J>> {
        let refused = self
            .claims
            .claim(host, at.calls, &self.remote.leases, pending);
        self.decide_all(host, refused)
    }

    pub fn answer<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        call: StoreCall,
    ) -> Answered<J, A> {
        let StoreCall { token, then, reply } = call;
        match then {
            Continuation::Claim => {
                let claimed = self.claims.answered(host, token, reply);
                self.send_parked(host, at);
                Answered {
                    decided: self.decide_all(host, claimed),
                    released: Vec::new(),
                }
            }
            Continuation::Settle | Continuation::Grant => {
                let grant = then == Continuation::Grant;
                Answered {
                    decided: Vec::new(),
                    released: self.store_answered(host, at, (token, grant), reply),
                }
            }
            _ => Answered::default(),
        }
    }

    /// A fan-out's claims in etcd, queued to settle: its answer, unless it is held until
    /// the settle is written.
    pub fn settle<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        counter: &Counter,
        ending: Ending<A>,
    ) -> Option<A> {
        let Ending {
            job,
            config,
            claims,
            delivered,
            log_id,
            now_ms,
            answer,
        } = ending;
        let Claims::Etcd(held) = claims else {
            return answer;
        };
        let Some(mut remote) = settle::settle_etcd(now_ms, &config, held, &delivered, log_id)
        else {
            return answer;
        };
        match answer {
            Some(answer) if answer.waits() => {
                remote.hold = Some(job);
                self.queue(host, at, counter, remote);
                self.held.push((job, answer));
                None
            }
            answer => {
                self.queue(host, at, counter, remote);
                answer
            }
        }
    }

    /// The settles queued go out now, if they can (none in flight); the answers of those
    /// that failed at once.
    pub fn send<H: Host>(&mut self, host: &H, at: &mut Acting<'_>) -> Vec<A> {
        if !self.remote.ready_to_send() {
            return Vec::new();
        }
        self.send_settles(host, at)
    }

    /// The root's timer: claims overdue, failed or without a lease too long, and settle txns
    /// whose answer never came, as store errors; then the claims parked and the settles owed
    /// go out, and the leases are kept ahead (for `config`'s store).
    pub fn tick<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        config: Option<&Config>,
    ) -> Answered<J, A> {
        let claimed = self.claims.tick(host, at.calls);
        let mut released = Vec::new();
        if self.remote.owed() > 0 {
            for (token, settles) in self.remote.overdue(host.now_ms()) {
                at.calls.take(token);
                released.extend(self.settles_ended(host, &settles, true));
            }
        }
        let decided = self.decide_all(host, claimed);
        self.send_parked(host, at);
        if self.remote.owed() > 0 {
            released.extend(self.send_settles(host, at));
        }
        remote::tick(host, at.calls, config, &mut self.remote);
        Answered { decided, released }
    }

    pub fn forget<H: Host>(
        &mut self,
        host: &H,
        at: &mut Acting<'_>,
        stream: u32,
        ended: bool,
    ) -> bool {
        let unsent = self.claims.forget(at.calls, stream, ended);
        // Its own claim txn forgotten, the claims parked meanwhile go out.
        self.send_parked(host, at);
        unsent
    }

    pub fn claiming(&self, stream: u32) -> bool {
        self.claims.holds(stream)
    }

    /// Fast ([`remote::SETTLE_TICK`]) while claims or settles are owed or (for a root whose
    /// `config` has the etcd store) a lease is not held yet; else, with the etcd store, slow
    /// enough to cost nothing and fast enough to keep the leases ahead
    /// ([`remote::LEASE_TICK`]).
    pub fn timer(&self, config: Option<&Config>) -> Option<Duration> {
        let etcd = config
            .and_then(|c| c.dedupe.as_ref())
            .is_some_and(|d| matches!(d.store, Store::Etcd(_)));
        let owed = self.remote.owed() > 0 || self.claims.needs_tick();
        if owed || (etcd && self.remote.wants_fast_timer()) {
            Some(remote::SETTLE_TICK)
        } else {
            etcd.then_some(remote::LEASE_TICK)
        }
    }

    /// Each request of `claimed` with what its claim came to.
    fn decide_all<H: Host>(&mut self, host: &H, claimed: Claimed<J>) -> Vec<Decision<J>> {
        claimed
            .into_iter()
            .map(|(pending, result)| self.decide(host, pending, result))
            .collect()
    }

    /// A request's claim answered: what the store found marked in its fan-out and the
    /// claims to settle, or its failure counted, logged, and decided by `on_store_error`.
    fn decide<H: Host>(
        &mut self,
        host: &H,
        pending: Pending<J, Ask>,
        result: Result<Found, StoreError>,
    ) -> Decision<J> {
        let Pending {
            stream,
            ask,
            started_ms,
            mut job,
            sender_left,
        } = pending;
        let (config, _, fanout) = job.claimant();
        let counter = Counter::new(config.metrics.then(|| self.telemetry.clone()));
        let decided = match result {
            Ok(found) => Decided::Claims(claimed(host, &counter, ask, &found, fanout)),
            Err(error) => {
                if error.lease_lost() {
                    self.remote.leases.forget();
                }
                let remote = &mut self.remote;
                let warn = || remote.warn(started_ms);
                match store_failed(host, &counter, config, stream, &error, warn) {
                    Ok(()) => Decided::Unrecorded,
                    Err(answer) => Decided::Refused(answer),
                }
            }
        };
        Decision {
            stream,
            job,
            sender_left,
            decided,
        }
    }
}
