//! One call as it is handed to Envoy: the cluster, the timeout, the header list and the body,
//! for each leg of a subscriber's delivery (the event, its dead letter, its reply). The
//! headers that do not depend on the request were made at configure time; a call adds the
//! forwarded ones, `Prefer: reply`, a dead letter's own, and the trace context: a traced
//! call's own `traceparent` (its attempt's span) in place of the sender's, and on a reply
//! (whose headers are the subscriber's answer's) the sender's when the call is not traced.

use std::borrow::Cow;

use super::spans::CallContext;
use super::Job;
use crate::call::Leg;
use crate::config::Channel;
use crate::headers::Forwarded;
use crate::reply::PREFER_REPLY;

/// One call, as it is handed to Envoy: what comes from the configuration lives as long as
/// `'c`, what comes from the job as long as `'a` (so the cluster's name outlives the plan
/// while the job is changed by the call's outcome).
pub(super) struct CallPlan<'a, 'c> {
    pub(super) cluster: &'c str,
    pub(super) timeout: std::time::Duration,
    base: &'c [(String, String)],
    /// `Prefer: reply`: the call is to a subscriber whose replies are passed on.
    prefer_reply: bool,
    extra: Vec<(String, String)>,
    forwarded: &'a Forwarded,
    /// Forwarded headers the `extra` ones replace (a dead letter's error attributes).
    replaced: Option<fn(&str) -> bool>,
    /// The call's own trace context (traced), replacing the forwarded one.
    trace: Option<&'a CallContext>,
    /// The request's forwarded headers, whose trace context a reply carries when untraced.
    sender: Option<&'a Forwarded>,
    pub(super) body: Cow<'a, [u8]>,
}

impl<'a, 'c> CallPlan<'a, 'c> {
    pub(super) fn new(
        job: &'a Job,
        channel: &'c Channel,
        index: usize,
        leg: Leg,
        trace: Option<&'a CallContext>,
    ) -> Option<CallPlan<'a, 'c>> {
        let sub = channel.subscribers.get(index)?;
        // The event as this subscriber takes it (`delivery.format`); its dead letter carries
        // the same, as Knative's dispatcher sends both in the format it forces.
        let (forwarded, body) = job.message(sub);
        Some(match leg {
            Leg::Event => CallPlan {
                cluster: &sub.cluster,
                timeout: sub.timeout,
                base: &sub.call_headers,
                prefer_reply: sub.reply.is_some(),
                extra: Vec::new(),
                forwarded,
                replaced: None,
                trace,
                sender: None,
                body: Cow::Borrowed(body),
            },
            Leg::DeadLetter => {
                let target = sub.dead_letter.as_ref()?;
                let letter = job.fanout.dead_letter(index, channel, forwarded, body);
                CallPlan {
                    cluster: &target.cluster,
                    timeout: target.timeout,
                    base: &target.call_headers,
                    prefer_reply: false,
                    extra: letter.headers,
                    forwarded,
                    replaced: Some(crate::dead_letter::replaces),
                    trace,
                    sender: None,
                    body: letter.body.map_or(Cow::Borrowed(body), Cow::Owned),
                }
            }
            Leg::Reply => {
                let target = sub.reply.as_ref()?;
                let reply = job.fanout.reply_event(index)?;
                CallPlan {
                    cluster: &target.cluster,
                    timeout: target.timeout,
                    base: &target.call_headers,
                    prefer_reply: false,
                    extra: Vec::new(),
                    forwarded: &reply.headers,
                    replaced: None,
                    trace,
                    sender: Some(forwarded),
                    body: Cow::Borrowed(&reply.body),
                }
            }
        })
    }

    pub(super) fn headers(&self) -> Vec<(&str, &[u8])> {
        let prefer = self.prefer_reply.then_some(PREFER_REPLY);
        // Sized once: the list is built for every call.
        let mut headers = Vec::with_capacity(
            self.base.len()
                + usize::from(prefer.is_some())
                + self.extra.len()
                + self.forwarded.len()
                + 2,
        );
        headers.extend(pairs(self.base));
        headers.extend(prefer.map(|(name, value)| (name, value.as_bytes())));
        headers.extend(pairs(&self.extra));
        if self.trace.is_some() || self.sender.is_some() {
            self.trace_context(&mut headers);
        }
        let traced = self.trace.is_some();
        match self.replaced {
            None if !traced => headers.extend(self.forwarded.iter()),
            replaced => headers.extend(self.forwarded.iter().filter(|(name, _)| {
                !(replaced.is_some_and(|replaced| replaced(name)) || traced && is_trace(name))
            })),
        }
        headers
    }

    /// The trace context a call carries of its own: its attempt's (traced), or on a reply the
    /// sender's. (Out of line: most calls have none, and the header list is built for every
    /// call.)
    #[inline(never)]
    fn trace_context(&self, headers: &mut Vec<(&'a str, &'a [u8])>) {
        match (self.trace, self.sender) {
            (Some(trace), _) => {
                headers.push(("traceparent", &trace.traceparent[..]));
                if let Some(state) = &trace.tracestate {
                    headers.push(("tracestate", state.as_bytes()));
                }
            }
            (None, Some(sender)) => headers.extend(sender.iter().filter(|(n, _)| is_trace(n))),
            (None, None) => {}
        }
    }
}

fn pairs(headers: &[(String, String)]) -> impl Iterator<Item = (&str, &[u8])> {
    headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_bytes()))
}

/// The W3C trace context's headers.
fn is_trace(name: &str) -> bool {
    name == "traceparent" || name == "tracestate"
}
