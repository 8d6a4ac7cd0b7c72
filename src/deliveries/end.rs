//! The end of a fan-out: its verdict and answer (early, for a sync sender whose required
//! subscribers are done while best-effort ones go on), what it logs and counts, and its
//! `dedupe` claims handed to the pipeline's settle stage ([`Ending`]).

use super::{Clock, Deliveries, Finished, Job};
use crate::answer::Answer;
use crate::config::AnswerMode;
use crate::dedupe::dedupe_store::Ending;
use crate::dedupe::settle::Claims;
use crate::host::Host;

impl Deliveries {
    pub(super) fn finish_if_done<H: Host>(
        &mut self,
        clock: &Clock<'_, H>,
        id: u64,
    ) -> Option<Finished> {
        let job = self.jobs.get_mut(&id)?;
        if !job.fanout.is_done() {
            return self.answer_if_due(id);
        }
        let mut job = self.jobs.remove(&id)?;
        let claims = job.claims.take();
        let answer = labelled(job.fanout.verdict(&job.channel), job.unrecorded);
        if let (Some(traces), true) = (self.traces.as_mut(), job.spans.is_some()) {
            traces.end(clock, &mut job, Some(&answer));
        }
        let duration = if job.config.metrics {
            clock.now().saturating_sub(job.started_ms)
        } else {
            0
        };
        self.log_and_count_end(clock.host, &job, &answer, duration);
        let finished = Finished {
            answer_to: job.answer_to,
            answer,
        };
        match claims {
            // The settle stage answers it once the claims are settled.
            Some(claims) => {
                self.ended(clock, id, &job, claims, Some(finished));
                None
            }
            None => Some(finished),
        }
    }

    /// What a fan-out that ended leaves in the log and the metrics (the answer not yet sent).
    fn log_and_count_end<H: Host>(&self, host: &H, job: &Job, answer: &Answer, duration: u64) {
        let channel = &job.channel;
        self.log_best_effort_failed(host, job);
        match job.config.mode {
            AnswerMode::Sync => {
                // (Answered already if nobody waits: best-effort deliveries went on after it.)
                if job.answer_to.is_some() && answer.status != 202 {
                    log::info!(
                        "[#{}] channel {}: answered {}: {} of {} subscriber(s) failed, {} skipped",
                        job.log_id,
                        channel.name,
                        answer.status,
                        job.fanout.failures().count(),
                        channel.subscribers.len(),
                        job.fanout.skipped()
                    );
                }
                self.count(host, &job.config, |tally| {
                    tally.fanout_ended(Some(duration))
                });
            }
            AnswerMode::Async => {
                if answer.status == 500 {
                    // The sender already has its 202: this is the only trace of the loss.
                    log::warn!(
                        "[#{}] channel {}: async delivery failed for good after the 202: {}",
                        job.log_id,
                        channel.name,
                        String::from_utf8_lossy(&answer.body)
                    );
                }
                // A 409 (dedupe: another request delivers to some subscribers) is no loss.
                let undelivered = job.fanout.failures().next().is_some();
                self.count(host, &job.config, |tally| {
                    if undelivered {
                        tally.undelivered();
                    }
                    tally.fanout_ended(Some(duration));
                });
            }
        }
    }

    /// Best-effort subscribers that failed for good: never in the answer's status, so logged
    /// and counted here (dead-lettered if configured: a dead-lettered one is not failed).
    fn log_best_effort_failed<H: Host>(&self, host: &H, job: &Job) {
        let failed = job.fanout.best_effort_failed(&job.channel);
        if failed == 0 {
            return;
        }
        log::warn!(
            "[#{}] channel {}: {failed} best-effort subscriber(s) failed for good",
            job.log_id,
            job.channel.name
        );
        // Async mode counts every failure after the 202 (`log_and_count_end`).
        if job.config.mode == AnswerMode::Sync {
            self.count(host, &job.config, |tally| tally.undelivered());
        }
    }

    /// A sync fan-out whose required subscribers have all ended while best-effort ones are
    /// still being delivered to: the sender is answered now (202 with `x-fanout-pending`, or
    /// the 500 of a required failure) and the rest goes on from the root context.
    fn answer_if_due(&mut self, id: u64) -> Option<Finished> {
        let job = self.jobs.get_mut(&id)?;
        if job.answer_to.is_none() || !job.fanout.required_done(&job.channel) {
            return None;
        }
        let answer = labelled(job.fanout.verdict(&job.channel), job.unrecorded);
        let answer_to = job.answer_to.take();
        Some(Finished { answer_to, answer })
    }

    /// Job `id` ended holding `claims`: handed to the settle stage.
    pub(super) fn ended<H: Host>(
        &mut self,
        clock: &Clock<'_, H>,
        id: u64,
        job: &Job,
        claims: Claims,
        answer: Option<Finished>,
    ) {
        let delivered = (0..job.channel.subscribers.len())
            .map(|index| job.fanout.is_delivered(index))
            .collect();
        self.ended.push(Ending {
            job: id,
            config: job.config.clone(),
            claims,
            delivered,
            log_id: job.log_id,
            now_ms: clock.now(),
            answer,
        });
    }

    /// Whether fan-outs ended holding claims since [`Deliveries::take_ended`] last ran.
    pub fn has_ended(&self) -> bool {
        !self.ended.is_empty()
    }

    /// The fan-outs that ended holding claims since the last call.
    pub fn take_ended(&mut self) -> Vec<Ending<Finished>> {
        std::mem::take(&mut self.ended)
    }
}

/// The answer of a fan-out whose outcome the etcd store will not record (`unrecorded`) says
/// so.
pub(super) fn labelled(answer: Answer, unrecorded: bool) -> Answer {
    if unrecorded {
        answer.with_header(crate::dedupe::settle::NOT_RECORDED_HEADER, "1".into())
    } else {
        answer
    }
}
