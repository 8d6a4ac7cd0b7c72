//! The etcd store's settles, and the answers that wait for them: a sync fan-out that claimed
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

use super::{Deliveries, Finished};
use crate::dedupe::claim::etcd_reply;
use crate::dedupe::remote::{Answered, Sent};
use crate::dedupe::settle::NOT_RECORDED_HEADER;
use crate::host::Host;

impl Deliveries {
    /// Sends the settles queued if no settle txn is in flight (from any context, as calls of
    /// root context `root`); those queued while one is in flight go out when it is answered.
    /// Returns the answers of fan-outs whose settle failed at once.
    pub fn flush_settles<H: Host>(&mut self, host: &H, root: u32) -> Vec<Finished> {
        if !self.store.ready_to_send() {
            return Vec::new();
        }
        self.send_settles(host, root)
    }

    /// The root's timer: settle txns whose answer never came are store errors; then every
    /// settle queued goes out.
    pub fn tick_settles<H: Host>(&mut self, host: &H, root: u32) -> Vec<Finished> {
        if self.store.owed() == 0 {
            return Vec::new();
        }
        let mut finished = Vec::new();
        for (token, settles) in self.store.overdue(host.now_ms()) {
            self.root_call_ended(token);
            finished.extend(self.settles_ended(&settles, true));
        }
        finished.extend(self.send_settles(host, root));
        finished
    }

    fn send_settles<H: Host>(&mut self, host: &H, root: u32) -> Vec<Finished> {
        let outcome = self.store.send_settles(host, host.now_ms(), root);
        for token in outcome.sent {
            self.owned_by_root(token, root);
        }
        self.settles_ended(&outcome.failed, true)
    }

    /// The answer to call `token` (the root context `root` is the current one), if it is one
    /// of the etcd store's root calls: a lease grant (the claims waiting for one go out), or
    /// a settle txn (the answers it held go out, and the settles queued since). `None` if it
    /// is not.
    pub fn store_answered<H: Host>(
        &mut self,
        host: &H,
        token: u32,
        num_headers: usize,
        body_size: usize,
        root: u32,
    ) -> Option<Vec<Finished>> {
        let answered = self.store.on_response(
            token,
            || etcd_reply(host, num_headers, body_size),
            || host.now_ms(),
        )?;
        self.root_call_ended(token);
        let mut finished = match answered {
            Answered::Grant => Vec::new(),
            Answered::Settles { settles, failed } => self.settles_ended(&settles, failed),
        };
        finished.extend(self.flush_settles(host, root));
        self.send_parked(host, root);
        Some(finished)
    }

    /// `settles` ended, applied or (`failed`) not: counted, and the answers they held let go.
    fn settles_ended(&mut self, settles: &[Sent], failed: bool) -> Vec<Finished> {
        if let Ok(mut telemetry) = self.telemetry.try_borrow_mut() {
            for _ in settles.iter().filter(|s| s.metrics) {
                telemetry.tally.owed(-1);
                if failed {
                    telemetry.tally.dedupe_store_error();
                }
            }
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

    /// Sync fan-outs ended whose answer waits for their settle.
    pub fn held_answers(&self) -> usize {
        self.held.len()
    }
}
