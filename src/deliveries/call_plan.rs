//! One call as it is handed to Envoy: the cluster, the timeout, the header list and the body,
//! for each leg of a subscriber's delivery (the event, its dead letter, its reply). The
//! headers that do not depend on the request were made at configure time; a call adds the
//! forwarded ones, `Prefer: reply` and a dead letter's own.

use std::borrow::Cow;

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
    pub(super) body: Cow<'a, [u8]>,
}

impl<'a, 'c> CallPlan<'a, 'c> {
    pub(super) fn new(
        job: &'a Job,
        channel: &'c Channel,
        index: usize,
        leg: Leg,
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
                + self.forwarded.len(),
        );
        headers.extend(pairs(self.base));
        headers.extend(prefer.map(|(name, value)| (name, value.as_bytes())));
        headers.extend(pairs(&self.extra));
        match self.replaced {
            None => headers.extend(self.forwarded.iter()),
            Some(replaced) => {
                headers.extend(self.forwarded.iter().filter(|(name, _)| !replaced(name)))
            }
        }
        headers
    }
}

fn pairs(headers: &[(String, String)]) -> impl Iterator<Item = (&str, &[u8])> {
    headers
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_bytes()))
}
