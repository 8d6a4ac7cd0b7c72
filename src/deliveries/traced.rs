//! Where the deliveries meet their spans ([`spans`](super::spans)): [`Traces`], the VM's
//! tracing set by the configuration, a traced request's spans made, each call's attempt
//! opened and ended, a fan-out's spans ended with it, and the exporter's batches sent from
//! the root context's timer (an export is a call of the [`CallTable`]). With `tracing` off
//! every entry here returns at its first line.

use std::time::Duration;

use super::call_end::AnsweredCall;
use super::spans::{CallContext, Tracing};
use super::{Clock, Job};
use crate::answer::Answer;
use crate::call::{Failure, Leg};
use crate::call_table::{CallTable, Continuation};
use crate::config::TracingConfig;
use crate::host::Host;
use crate::jitter;
use crate::telemetry::{count_into, Telemetry};
use crate::trace::Verdict;
use std::cell::RefCell;

/// The status a fan-out's span ends with when its sender went away before the answer
/// (nginx's "client closed request": no answer was sent).
const CLIENT_GONE: u16 = 499;

/// How a traced call ended, as its attempt's span tells it.
pub(super) struct CallOutcome {
    status: Option<u16>,
    failure: Option<Failure>,
    retry_after_ms: Option<u64>,
}

impl CallOutcome {
    pub(super) fn of(ended: &AnsweredCall) -> CallOutcome {
        CallOutcome {
            status: ended.status,
            failure: ended.end.result.clone().err(),
            retry_after_ms: ended.end.retry_after_ms,
        }
    }

    /// Refused by Envoy at dispatch.
    pub(super) fn failed(failure: Failure) -> CallOutcome {
        CallOutcome {
            status: None,
            failure: Some(failure),
            retry_after_ms: None,
        }
    }
}

/// The VM's tracing as the deliveries use it, while `tracing` is configured: ids, sampling
/// and the exporter, and whether spans dropped are counted (metrics on).
pub(super) struct Traces {
    /// The sampler and ids: a new request's spans are its (`Deliveries::traced`).
    pub(super) tracing: Tracing,
    count_span_drops: bool,
}

impl Traces {
    /// The tracing of a (new) configuration into `traces` (`None`: off; spans of fan-outs
    /// under way are then dropped as they end).
    pub(super) fn configure<H: Host>(
        traces: &mut Option<Traces>,
        host: &H,
        config: Option<&TracingConfig>,
        metrics: bool,
        root: u32,
    ) {
        let Some(config) = config else {
            *traces = None;
            return;
        };
        let seed = jitter::seed(&[host.now_nanos(), u64::from(root), 0x0074_7261_6365]);
        match traces {
            Some(traces) => {
                traces.tracing.reconfigure(config, seed);
                traces.count_span_drops = metrics;
            }
            None => {
                *traces = Some(Traces {
                    tracing: Tracing::new(config, seed),
                    count_span_drops: metrics,
                })
            }
        }
    }

    /// `job`'s call to subscriber `index` (`leg`) goes out: its attempt's span, and the
    /// context the call carries.
    pub(super) fn call<H: Host>(
        &mut self,
        clock: &Clock<'_, H>,
        job: &mut Job,
        index: usize,
        leg: Leg,
    ) -> Option<CallContext> {
        let spans = job.spans.as_mut()?;
        let sub = job.channel.subscribers.get(index)?;
        spans.call(&mut self.tracing, sub, index, leg, clock.now_ns())
    }

    /// `job`'s call to subscriber `index` ended (recorded in its fan-out already).
    pub(super) fn call_ended<H: Host>(
        &mut self,
        clock: &Clock<'_, H>,
        job: &mut Job,
        index: usize,
        ended: &CallOutcome,
    ) {
        let (Some(spans), Some(progress)) = (job.spans.as_mut(), job.fanout.progress(index)) else {
            return;
        };
        spans.call_ended(
            &mut self.tracing,
            index,
            ended.status,
            ended.failure.as_ref(),
            ended.retry_after_ms,
            progress,
            clock.now_ns(),
        );
    }

    /// `job` ended (removed from the deliveries) with `answer` (`None`: its sender went
    /// away): its spans end.
    pub(super) fn end<H: Host>(
        &mut self,
        clock: &Clock<'_, H>,
        job: &mut Job,
        answer: Option<&Answer>,
    ) {
        let Some(spans) = job.spans.take() else {
            return;
        };
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let verdict = Verdict {
            status: answer.map_or(CLIENT_GONE, |a| u16::try_from(a.status).unwrap_or(u16::MAX)),
            subscribers: count(job.channel.subscribers.len()),
            failed: count(job.fanout.failures().count()),
            dead_lettered: count(job.fanout.dead_lettered()),
        };
        let fanout = &job.fanout;
        spans.end(
            &mut self.tracing,
            &verdict,
            |i| fanout.progress(i),
            clock.now_ns(),
        );
    }

    /// The continuation of an export: the collector's answer to call `token`.
    pub(super) fn export_answered<H: Host>(&mut self, host: &H, token: u32) {
        self.tracing.export_answered(token, || host.call_status());
    }

    /// The root context's timer: the batch of spans due goes to the collector (`flush`:
    /// whatever is held, the VM is going away), a warning for spans lost is logged when due,
    /// and the losses are counted (`fanout.tracing.spans_dropped`). The export is root
    /// context `root`'s call.
    pub(super) fn export<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        telemetry: &RefCell<Telemetry>,
        root: u32,
        flush: bool,
    ) {
        let tracing = &mut self.tracing;
        let now = host.now_ms();
        if let Some(export) = tracing.export_due(now, flush) {
            let headers = export
                .headers
                .iter()
                .map(|(name, value)| (name.as_str(), value.as_bytes()))
                .collect();
            let timeout = Duration::from_millis(u64::from(export.timeout_ms));
            let token = match host.dispatch(&export.cluster, headers, &export.body, timeout) {
                Ok(token) => Some(token),
                Err(failure) => {
                    log::debug!(
                        "tracing: the export of {} spans to cluster {} was refused: {failure}",
                        export.spans,
                        export.cluster
                    );
                    None
                }
            };
            if let Some(token) = token {
                calls.insert(token, Continuation::Export, Some(root));
            }
            tracing.exported(token);
        }
        let (warning, dropped) = tracing.losses(now);
        if let Some(warning) = warning {
            log::warn!("{warning}");
        }
        if dropped > 0 && self.count_span_drops {
            count_into(telemetry, host, |tally| tally.spans_dropped(dropped));
        }
    }
}
