//! The settle and answer stages: when a fan-out holding `dedupe` claims ends, its claims are
//! settled (in Envoy's shared data at once; in etcd as a txn queued for the root context),
//! and the answers that wait for the etcd settles are held.
//!
//! With the etcd store: a sync fan-out that claimed
//! in etcd is answered only once its settle is answered, so that when its sender hears the
//! answer what it delivered is in etcd (a redelivery through any replica, this one dead or
//! alive, calls only the subscribers without a record). The settles are calls of a root
//! context (Envoy cancels a stream's calls when the stream ends); the answer goes to the
//! stream from there, as a parked request's does.
//!
//! A settle that fails (etcd unreachable, no lease for the records, no answer) is a store
//! error: counted, logged (at most once per 10 s), and the answer held for it goes out as the
//! fan-out decided it, with [`NOT_RECORDED_HEADER`]: a `202` stays a `202` (every subscriber
//! has the event; an error would make the sender redeliver it to all of them), a `500` stays a
//! `500` (the sender must redeliver; the subscribers that took it may be called again).

use super::{Actor, Pipeline};
use crate::dedupe::claim::etcd_reply;
use crate::dedupe::etcd::remote::{self, Sent};
use crate::dedupe::settle::{self, NOT_RECORDED_HEADER};
use crate::deliveries::Finished;
use crate::host::Host;
use crate::telemetry::{count_into, Counter};

impl Pipeline {
    /// Settles the claims of the fan-outs that ended (an etcd settle is queued, holding back
    /// a sync sender's answer); adds the answers not held to `finished`.
    pub(super) fn queue_ended<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        finished: &mut Vec<Finished>,
    ) {
        if !self.deliveries.has_ended() {
            return;
        }
        for ended in self.deliveries.take_ended() {
            let counter = self.counter(&ended.config);
            let mut settled = settle::settle(
                host,
                ended.now_ms,
                &ended.config,
                ended.claims,
                &ended.delivered,
                ended.log_id,
            );
            counter.count(host, |tally| settled.record(tally));
            let Some(answer) = ended.answer else {
                if let Some(remote) = settled.remote.take() {
                    self.queue(host, actor, &counter, remote);
                }
                continue;
            };
            match settled.remote.take() {
                Some(mut remote) if answer.answer_to.is_some() => {
                    remote.hold = Some(ended.job);
                    self.queue(host, actor, &counter, remote);
                    self.held.push((ended.job, answer));
                }
                Some(remote) => {
                    self.queue(host, actor, &counter, remote);
                    finished.push(answer);
                }
                None => finished.push(answer),
            }
        }
    }

    /// An etcd settle owed: sent at the next tick of `actor`'s root, quickened for it.
    fn queue<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        counter: &Counter,
        remote: settle::RemoteSettle,
    ) {
        self.etcd.queue(remote);
        self.timers.hurry(host, actor.root(), remote::SETTLE_TICK);
        counter.count(host, |tally| tally.owed(1));
    }

    /// Sends the settles queued if no settle txn is in flight (from any context, as calls of
    /// the acting root); those queued while one is in flight go out when it is answered.
    /// Adds the answers of fan-outs whose settle failed at once to `finished`.
    pub(super) fn flush_settles<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        finished: &mut Vec<Finished>,
    ) {
        if self.etcd.ready_to_send() {
            finished.extend(self.send_settles(host, actor));
        }
    }

    /// The root's timer: settle txns whose answer never came are store errors; then every
    /// settle queued goes out.
    pub(super) fn tick_settles<H: Host>(&mut self, host: &H, actor: Actor) -> Vec<Finished> {
        if self.etcd.owed() == 0 {
            return Vec::new();
        }
        let mut finished = Vec::new();
        for (token, settles) in self.etcd.overdue(host.now_ms()) {
            self.calls.take(token);
            finished.extend(self.settles_ended(host, &settles, true));
        }
        finished.extend(self.send_settles(host, actor));
        finished
    }

    fn send_settles<H: Host>(&mut self, host: &H, actor: Actor) -> Vec<Finished> {
        let root = actor.root();
        let failed = self
            .etcd
            .send_settles(host, &mut self.calls, host.now_ms(), root);
        self.settles_ended(host, &failed, true)
    }

    /// The continuation of the etcd store's calls of a root: lease grant `token` (`grant`;
    /// the lease is held, or asked again later) or settle txn `token` (the answers it held
    /// go out); then the settles queued since and the claims waiting go out.
    pub(super) fn store_answered<H: Host>(
        &mut self,
        host: &H,
        actor: Actor,
        (token, grant): (u32, bool),
        (num_headers, body_size): (usize, usize),
    ) -> Vec<Finished> {
        let reply = || etcd_reply(host, num_headers, body_size);
        let mut finished = Vec::new();
        if grant {
            self.etcd.grant_answered(token, reply, || host.now_ms());
        } else if let Some((settles, failed)) =
            self.etcd.settle_answered(token, reply, || host.now_ms())
        {
            finished = self.settles_ended(host, &settles, failed);
        }
        self.flush_settles(host, actor, &mut finished);
        self.send_parked(host, actor);
        finished
    }

    /// `settles` ended, applied or (`failed`) not: counted, and the answers they held let go.
    fn settles_ended<H: Host>(
        &mut self,
        host: &H,
        settles: &[Sent],
        failed: bool,
    ) -> Vec<Finished> {
        let counted = settles.iter().filter(|s| s.metrics).count() as u64;
        if counted > 0 {
            count_into(&self.telemetry, host, |tally| {
                tally.owed(-(counted as i64));
                if failed {
                    tally.dedupe_store_errors(counted);
                }
            });
        }
        let mut finished = Vec::new();
        for job in settles.iter().filter_map(|s| s.hold) {
            let Some(at) = self.held.iter().position(|(id, _)| *id == job) else {
                continue;
            };
            let (_, mut done) = self.held.swap_remove(at);
            if failed {
                done.answer = done.answer.with_header(NOT_RECORDED_HEADER, "1".into());
            }
            finished.push(done);
        }
        finished
    }
}
