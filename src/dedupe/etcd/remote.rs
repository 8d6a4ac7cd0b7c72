//! The etcd store's side of one VM, kept by the root context: the leases granted ahead of
//! need, the settles owed (queued by whichever context ended a fan-out, sent by the root's
//! timer, since Envoy cancels a stream's calls when the stream ends), and the store-error
//! warnings (one per 10 s at most).
//!
//! A sync fan-out's answer waits for its settle (the deliveries hold it): so when its sender
//! hears the answer, what it delivered is in etcd. A settle goes out at once, as a call of
//! the root context, when no settle txn of this VM is in flight; else it waits for the one in
//! flight to be answered, and the settles queued meanwhile go out together, as one txn per
//! lease (up to [`MAX_SETTLES_PER_TXN`] events each, no key twice): at low load no wait, and
//! under load an event costs its claim and a share of a settle.
//!
//! The timer runs at [`SETTLE_TICK`] only while something is owed: settles queued or in
//! flight, a lease grant pending. Otherwise every [`LEASE_TICK`], enough to ask for the next
//! bucket's lease in time (buckets are at least a second wide). A settle queued while the
//! timer is slow asks for the fast one from the context that queues it ([`Remote::queue`]).

use std::time::Duration;

use super::{self as etcd, Family, Leases, SettleOp, StoreError, MAX_SETTLES_PER_TXN};
use crate::call::Failure;
use crate::call_table::{CallTable, Continuation};
use crate::config::{Config, EtcdStore, Store};
use crate::dedupe::settle::RemoteSettle;
use crate::dedupe::CLAIM_MARGIN_MS;
use crate::host::Host;

/// At most one store-error warning per this long.
const WARNING_EVERY_MS: u64 = 10_000;
/// The root's timer while settles are owed or a grant is pending (the plugin's delivery
/// tick): the most a settle waits before it goes out.
pub const SETTLE_TICK: Duration = Duration::from_millis(10);
/// The root's timer when the etcd store owes nothing: a quarter of the narrowest lease
/// bucket (1 s), so that every bucket sees ticks to ask for the next one's lease.
pub const LEASE_TICK: Duration = Duration::from_millis(250);

/// The VM's etcd state.
#[derive(Default)]
pub struct Remote {
    pub leases: Leases,
    families: Vec<Family>,
    /// Settles to send at the next tick.
    queued: Vec<RemoteSettle>,
    /// Settle txns sent: token, when their answer is overdue, and the settles in it.
    in_flight: Vec<(u32, u64, Vec<Sent>)>,
    last_warning_ms: Option<u64>,
    unlogged: u32,
}

/// A settle sent: its context id (for log lines), whether counted in the metrics, and the
/// answer it holds back (a sync fan-out's job id), if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    pub log_id: u32,
    pub metrics: bool,
    pub hold: Option<u64>,
}

impl Sent {
    /// What is kept of `settle` while its txn is in flight.
    pub fn of(settle: &RemoteSettle) -> Sent {
        Sent {
            log_id: settle.log_id,
            metrics: settle.metrics,
            hold: settle.hold,
        }
    }
}

/// How long after its timeout a settle txn's answer is given up on (Envoy answers a
/// timed-out call itself; this is for an answer that never comes at all).
const OVERDUE_MARGIN_MS: u64 = 1_000;

impl Remote {
    /// The lease kinds of a (new) configuration: records (`ttl_ms`) and claims (the longest
    /// delivery and a margin). Leases of other kinds are dropped (they expire in etcd).
    pub fn configure(&mut self, families: Vec<Family>) {
        if self.families != families {
            self.leases.forget();
            self.families = families;
        }
    }

    /// A settle owed, sent at the next tick (the caller quickens the timer to
    /// [`SETTLE_TICK`]).
    pub fn queue(&mut self, settle: RemoteSettle) {
        self.queued.push(settle);
    }

    /// Settles queued or in flight: work the process still owes.
    pub fn owed(&self) -> usize {
        self.queued.len()
            + self
                .in_flight
                .iter()
                .map(|(_, _, settles)| settles.len())
                .sum::<usize>()
    }

    /// Whether settles are queued and none is in flight: they go out now, not at the tick.
    pub fn ready_to_send(&self) -> bool {
        !self.queued.is_empty() && self.in_flight.is_empty()
    }

    /// Settle txns whose answer is overdue at `now_ms` (Envoy lost it): taken out, each
    /// settle in them a store error.
    pub fn overdue(&mut self, now_ms: u64) -> Vec<(u32, Vec<Sent>)> {
        let mut overdue = Vec::new();
        let mut i = 0;
        while let Some((token, due, _)) = self.in_flight.get(i) {
            if *due <= now_ms {
                let token = *token;
                let (_, _, settles) = self.in_flight.swap_remove(i);
                let error = StoreError::new("no answer to the settle txn, long past its timeout");
                for s in &settles {
                    self.settle_failed(s.log_id, &error, now_ms);
                }
                overdue.push((token, settles));
            } else {
                i += 1;
            }
        }
        overdue
    }

    /// Whether the timer must run at [`SETTLE_TICK`]: settles owed, or leases not held yet
    /// (a grant pending, or none granted).
    pub fn wants_fast_timer(&self) -> bool {
        self.owed() > 0 || !self.families.is_empty() && !self.leases.all_granted()
    }

    /// Whether to log a store-error warning now; if so, how many were not logged since.
    pub fn warn(&mut self, now_ms: u64) -> Option<u32> {
        match self.last_warning_ms {
            Some(last) if now_ms.saturating_sub(last) < WARNING_EVERY_MS => {
                self.unlogged = self.unlogged.saturating_add(1);
                None
            }
            _ => {
                self.last_warning_ms = Some(now_ms);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }

    /// Asks for the leases due (the root context is the current one). Returns the first
    /// refusal at dispatch (`on_configure` refuses a cluster Envoy does not have).
    pub fn grant<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        now_ms: u64,
        store: &EtcdStore,
    ) -> Result<(), crate::call::Failure> {
        let families = self.families.clone();
        for grant in self.leases.wanted(now_ms, &families) {
            let headers = etcd::call_headers(&store.cluster, etcd::GRANT_PATH);
            let timeout = Duration::from_millis(u64::from(store.timeout_ms));
            match host.dispatch(&store.cluster, headers, &grant.body, timeout) {
                Ok(token) => {
                    calls.insert(token, Continuation::Grant, None);
                    self.leases.asked(grant.until_ms, token);
                }
                Err(failure) => {
                    self.leases.not_sent(now_ms);
                    return Err(failure);
                }
            }
        }
        Ok(())
    }

    /// Sends the settles queued as calls of root context `root` (from whichever context
    /// runs), as few txns as their leases, clusters and etcd's limits allow; each txn is a
    /// [`Continuation::Settle`] of `calls`. Returns the settles that ended at once (no lease,
    /// refused at dispatch), each a store error.
    pub fn send_settles<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        now_ms: u64,
        root: u32,
    ) -> Vec<Sent> {
        let mut failed = Vec::new();
        let mut batches: Vec<Batch> = Vec::new();
        for settle in std::mem::take(&mut self.queued) {
            let lease = if settle.records.is_none() {
                Some(0)
            } else {
                self.leases.pick(settle.until_ms)
            };
            let Some(lease) = lease else {
                let error = StoreError::new("no etcd lease for the records");
                self.settle_failed(settle.log_id, &error, now_ms);
                failed.push(Sent::of(&settle));
                continue;
            };
            match batches.iter_mut().find(|b| b.takes(&settle, lease)) {
                Some(batch) => batch.settles.push(settle),
                None => batches.push(Batch {
                    lease,
                    settles: vec![settle],
                }),
            }
        }
        for batch in batches {
            if let Err(refused) = self.send_batch(host, calls, now_ms, root, batch) {
                failed.extend(refused);
            }
        }
        failed
    }

    /// Sends one txn of settles; `Err`: Envoy refused it, its settles each a store error.
    fn send_batch<H: Host>(
        &mut self,
        host: &H,
        calls: &mut CallTable,
        now_ms: u64,
        root: u32,
        batch: Batch,
    ) -> Result<(), Vec<Sent>> {
        let Some(first) = batch.settles.first() else {
            return Ok(());
        };
        let (cluster, timeout_ms) = (first.cluster.clone(), first.timeout_ms);
        let ops: Vec<SettleOp<'_>> = batch
            .settles
            .iter()
            .map(|s| SettleOp {
                claim_key: &s.claim.0,
                claim: &s.claim.1,
                records: s.records.as_ref().map(|(k, v)| (k.as_slice(), v.as_str())),
            })
            .collect();
        let body = etcd::settle_body(&ops, batch.lease);
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        let settles: Vec<Sent> = batch.settles.iter().map(Sent::of).collect();
        let headers = etcd::call_headers(&cluster, etcd::TXN_PATH);
        match host.dispatch_for(root, &cluster, headers, &body, timeout) {
            Ok(token) => {
                let due = now_ms
                    .saturating_add(u64::from(timeout_ms))
                    .saturating_add(OVERDUE_MARGIN_MS);
                self.in_flight.push((token, due, settles));
                calls.insert(token, Continuation::Settle, Some(root));
                Ok(())
            }
            Err(failure) => {
                let error = StoreError::new(format!("refused at dispatch: {failure}"));
                for sent in &settles {
                    self.settle_failed(sent.log_id, &error, now_ms);
                }
                Err(settles)
            }
        }
    }

    fn settle_failed(&mut self, log_id: u32, error: &StoreError, now_ms: u64) {
        if error.lease_lost() {
            self.leases.forget();
        }
        if let Some(unlogged) = self.warn(now_ms) {
            let earlier = if unlogged > 0 {
                format!(" ({unlogged} more since the last warning)")
            } else {
                String::new()
            };
            log::warn!(
                "[#{log_id}] dedupe: could not record the outcome in etcd: {error}; its \
                 claims lapse on their own, its deliveries may be repeated{earlier}"
            );
        }
    }

    /// The answer to lease grant `token` (`reply` reads it).
    pub fn grant_answered(
        &mut self,
        token: u32,
        reply: impl FnOnce() -> etcd::Reply,
        now: impl FnOnce() -> u64,
    ) {
        let result = etcd::read_answer(&reply()).and_then(etcd::read_grant);
        if let Err(error) = &result {
            log::debug!("dedupe: etcd lease grant failed: {error}");
        }
        let failed = result.is_err();
        self.leases
            .granted(token, result, if failed { now() } else { 0 });
    }

    /// The answer to settle txn `token` (`reply` reads it): the settles in it, applied, or
    /// (`true`) each a store error; `None` if it was given up on already.
    pub fn settle_answered(
        &mut self,
        token: u32,
        reply: impl FnOnce() -> etcd::Reply,
        now: impl FnOnce() -> u64,
    ) -> Option<(Vec<Sent>, bool)> {
        let at = self.in_flight.iter().position(|(t, _, _)| *t == token)?;
        let (_, _, settles) = self.in_flight.swap_remove(at);
        match etcd::read_answer(&reply()).and_then(etcd::read_txn_ok) {
            Ok(()) => Some((settles, false)),
            Err(error) => {
                let now = now();
                for sent in &settles {
                    self.settle_failed(sent.log_id, &error, now);
                }
                Some((settles, true))
            }
        }
    }
}

/// Settles sent as one txn: the same lease (or none needed), cluster and timeout, at most
/// [`MAX_SETTLES_PER_TXN`] of them, and no key twice (etcd refuses a txn that names a key in
/// two operations; an event's records key follows from its claim key, so comparing the claim
/// keys is enough).
struct Batch {
    lease: i64,
    settles: Vec<RemoteSettle>,
}

impl Batch {
    fn takes(&self, settle: &RemoteSettle, lease: i64) -> bool {
        let Some(first) = self.settles.first() else {
            return false;
        };
        lease == self.lease
            && first.cluster == settle.cluster
            && first.timeout_ms == settle.timeout_ms
            && self.settles.len() < MAX_SETTLES_PER_TXN
            && !self.settles.iter().any(|s| s.claim.0 == settle.claim.0)
    }
}

/// At configure time: the etcd store's lease kinds of `config`; the leases are granted by the
/// timer. (Not here: Envoy's main-thread VM is configured before its clusters are ready, and
/// refuses a call to any cluster then, known or not; so a cluster Envoy does not have cannot
/// be told at configure time, and is reported by the timer instead.)
pub fn prepare(remote: &mut Remote, config: &Config) {
    let Some(dedupe) = &config.dedupe else {
        return;
    };
    if !matches!(dedupe.store, Store::Etcd(_)) {
        return;
    }
    let longest = config
        .channels
        .iter()
        .flat_map(|c| &c.subscribers)
        .map(|s| s.worst_case_ms())
        .max()
        .unwrap_or(0);
    let families = vec![
        Family::for_horizon(dedupe.ttl_ms),
        Family::for_horizon(longest.saturating_add(CLAIM_MARGIN_MS)),
    ];
    remote.configure(families);
}

/// The root context's timer (the root is the current context): the leases due. Nothing
/// unless `config` uses the etcd store. (The settles are the deliveries': they hold the
/// answers that wait for them.)
pub fn tick<H: Host>(
    host: &H,
    calls: &mut CallTable,
    config: Option<&Config>,
    remote: &mut Remote,
) {
    let Some(Store::Etcd(store)) = config.and_then(|c| c.dedupe.as_ref()).map(|d| &d.store) else {
        return;
    };
    let now = host.now_ms();
    if let Err(Failure::DispatchError { detail }) = remote.grant(host, calls, now, store) {
        if remote.warn(now).is_some() {
            log::error!(
                "dedupe.store.etcd.cluster: Envoy refused a call to \"{}\" ({detail}); \
                 every event is treated as a store error (on_store_error)",
                store.cluster
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settle(event: &str, cluster: &str) -> RemoteSettle {
        RemoteSettle {
            cluster: cluster.into(),
            timeout_ms: 250,
            claim: (format!("{event}/c").into_bytes(), "c".into()),
            records: Some((format!("{event}/d").into_bytes(), "d".into())),
            until_ms: 0,
            log_id: 1,
            metrics: true,
            hold: None,
        }
    }

    #[test]
    fn a_batch_takes_the_same_lease_and_cluster_no_key_twice_and_at_most_126_settles() {
        let batch = Batch {
            lease: 7,
            settles: vec![settle("a", "etcd")],
        };
        assert!(batch.takes(&settle("b", "etcd"), 7));
        assert!(!batch.takes(&settle("b", "etcd"), 8), "another lease");
        assert!(!batch.takes(&settle("b", "other"), 7), "another cluster");
        assert!(!batch.takes(&settle("a", "etcd"), 7), "a's keys twice");
        let full = |n: usize| Batch {
            lease: 7,
            settles: (0..n).map(|i| settle(&format!("e{i}"), "etcd")).collect(),
        };
        assert!(full(125).takes(&settle("x", "etcd"), 7), "the 126th");
        assert!(!full(126).takes(&settle("x", "etcd"), 7), "a 127th");
    }
}
