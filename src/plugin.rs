//! The plugin: what Envoy's root context does, without proxy-wasm. It reads and validates the
//! configuration (`on_configure`), keeps the timer the deliveries and the metrics need
//! (`on_tick`), takes the answers to the calls made from the root context (retries, async
//! deliveries) and creates a [`Stream`] for every request.
//!
//! The glue (`filter/`) forwards each root-context callback here and nothing else. Claims,
//! calls, their answers, retries and settles belong to the [`Pipeline`], shared by the plugin
//! and its streams; see [`crate::deliveries`] for who sends what.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use crate::cell::with_mut;
use crate::config::Config;
use crate::deliveries::{Finished, Owed};
use crate::host::Host;
use crate::pipeline::{Actor, Pipeline};
use crate::stream::{answer_stream, Stream};
use crate::telemetry::{Counter, Telemetry};

/// How often the root context hands the counts to Envoy's stats.
const METRICS_FLUSH: Duration = Duration::from_secs(1);
/// The root context's timer while `tracing` is on: a span waits at most its batch's delay
/// (`max_batch_delay_ms`) and this.
const TRACE_TICK: Duration = Duration::from_millis(100);

/// The plugin: holds the configuration, parsed once per `on_configure`, shared (`Rc`) with
/// every stream created after it. A stream keeps the configuration it started with.
pub struct Plugin<H> {
    id: u32,
    host: H,
    config: Option<Rc<Config>>,
    /// This worker's counts, shared with its streams; flushed to Envoy on the timer.
    telemetry: Rc<RefCell<Telemetry>>,
    pipeline: Rc<RefCell<Pipeline>>,
    last_flush_ms: u64,
    /// The VM's newest configured root context and whether its timer runs (see `on_tick`).
    newest: Rc<Cell<(u32, bool)>>,
    /// `on_done` came while this root's own calls were in flight: it waits for their answers
    /// (Envoy cancels a deleted context's calls) and then tells Envoy, once.
    retiring: bool,
    retired: bool,
}

/// What every root context of one VM shares. A configuration update (e.g. through ECDS)
/// starts a new root context in the same VM while the old one's streams and deliveries are
/// still under way: they must go on counting into the same tally, and the new root's timer
/// must carry on the old one's retries.
#[derive(Clone)]
pub struct VmShared {
    telemetry: Rc<RefCell<Telemetry>>,
    pipeline: Rc<RefCell<Pipeline>>,
    newest: Rc<Cell<(u32, bool)>>,
}

impl Default for VmShared {
    fn default() -> Self {
        let telemetry: Rc<RefCell<Telemetry>> = Rc::default();
        VmShared {
            pipeline: Rc::new(RefCell::new(Pipeline::new(telemetry.clone()))),
            telemetry,
            newest: Rc::default(),
        }
    }
}

thread_local! {
    /// One per VM: Envoy runs each VM on one thread.
    static VM_SHARED: VmShared = VmShared::default();
}

impl VmShared {
    /// This VM's.
    pub fn of_this_vm() -> VmShared {
        VM_SHARED.with(VmShared::clone)
    }
}

impl<H: Host + Clone> Plugin<H> {
    /// A root context with state of its own (tests).
    pub fn new(id: u32, host: H) -> Self {
        Plugin::with_shared(id, host, VmShared::default())
    }

    /// A root context sharing `shared` with the VM's other root contexts.
    pub fn with_shared(id: u32, host: H, shared: VmShared) -> Self {
        Plugin {
            id,
            host,
            config: None,
            pipeline: shared.pipeline,
            telemetry: shared.telemetry,
            last_flush_ms: 0,
            newest: shared.newest,
            retiring: false,
            retired: false,
        }
    }

    pub fn on_vm_start(&mut self) -> bool {
        self.host.follow_log_level();
        true
    }

    /// A configuration that does not validate is refused: Envoy does not start with it, and
    /// on an update keeps serving the previous one.
    pub fn on_configure(&mut self) -> bool {
        self.host.follow_log_level();
        let bytes = self.host.plugin_configuration().unwrap_or_default();
        match Config::from_json(&bytes) {
            Ok(mut config) => {
                for name in config.forward.sensitive_entries() {
                    log::warn!(
                        "forward_headers lists \"{name}\": it is forwarded to every \
                         subscriber"
                    );
                }
                for warning in &config.warnings {
                    log::warn!("{warning}");
                }
                let subscribers: usize = config.channels.iter().map(|c| c.subscribers.len()).sum();
                log::info!(
                    "configured {} channel(s), {} subscriber(s)",
                    config.channels.len(),
                    subscribers
                );
                if config.metrics {
                    self.define_metrics(&mut config);
                }
                with_mut(&self.pipeline, |p| {
                    p.configure(&self.host, &config, self.id)
                });
                self.config = Some(Rc::new(config));
                self.newest.set((self.id, false));
                self.retune_timer();
                true
            }
            Err(error) => {
                log::error!("invalid plugin configuration: {error}");
                false
            }
        }
    }

    /// Makes the metrics of `config` exist (at zero) before anything happens, and fixes
    /// where each subscriber's calls are counted (`Subscriber::stats`).
    fn define_metrics(&self, config: &mut Config) {
        with_mut(&self.telemetry, |telemetry| {
            telemetry.tally.register_requests();
            if config.dedupe.is_some() {
                telemetry.tally.register_dedupe();
            }
            if config.tracing.is_some() {
                telemetry.tally.register_tracing();
            }
            for (cluster, _) in &config.call_caps {
                telemetry.tally.register_call_cap(cluster);
            }
            // The channels are this configuration's alone until it is shared.
            let channels = config.channels.iter_mut().filter_map(Rc::get_mut);
            for subscriber in channels.flat_map(|c| &mut c.subscribers) {
                let tally = &mut telemetry.tally;
                subscriber.stats.event = tally.register_subscriber(&subscriber.cluster);
                if let Some(reply) = &subscriber.reply {
                    tally.register_replies(&subscriber.cluster);
                    subscriber.stats.reply = tally.cluster(&reply.cluster);
                }
                if let Some(dead_letter) = &subscriber.dead_letter {
                    subscriber.stats.dead_letter = tally.cluster(&dead_letter.cluster);
                }
            }
            telemetry.define_all(&self.host);
        });
    }

    pub fn on_tick(&mut self) {
        // A retired root waiting for its own calls sends nothing new while the newest root's
        // timer runs (that one carries the VM's deliveries on), so that it can end.
        let (newest, newest_ticks) = self.newest.get();
        if !self.retiring || newest == self.id || !newest_ticks {
            let config = self.config.as_deref();
            let finished = with_mut(&self.pipeline, |p| p.tick(&self.host, self.id, config));
            self.deliver(finished.unwrap_or_default());
        }
        let now = self.host.now_ms();
        let period = self.pipeline.try_borrow().map(|p| p.timer(self.id));
        if period.is_ok_and(|p| p >= METRICS_FLUSH)
            || now.saturating_sub(self.last_flush_ms) >= 1000
        {
            with_mut(&self.telemetry, |telemetry| telemetry.flush(&self.host));
            self.last_flush_ms = now;
        }
        self.retune_timer();
    }

    /// Hands what was counted since the last flush to Envoy's stats now, whatever the timer's
    /// period: for a glue with no timer of its own (the native build), when no stream is left
    /// on the worker to end a later hook.
    pub fn flush_metrics(&mut self) {
        with_mut(&self.telemetry, |telemetry| telemetry.flush(&self.host));
        self.last_flush_ms = self.host.now_ms();
    }

    /// Answers to the calls the root made (retries, async deliveries).
    pub fn on_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let actor = Actor::Root(self.id);
        let finished = with_mut(&self.pipeline, |p| {
            p.on_response(&self.host, actor, token, num_headers, body_size)
        });
        self.deliver(finished.unwrap_or_default());
    }

    /// The plugin is being retired (a newer configuration took over, or Envoy stops): hand
    /// over what was counted since the last tick. What the VM still owes is logged. Its
    /// fan-outs belong to the VM, and the newest root's timer carries them on; but Envoy
    /// cancels the calls of a context it deletes, so while calls this root made are in
    /// flight (or, for the newest root, while anything is owed) it answers `false` and
    /// [`Plugin::take_retired`] tells the glue when to let Envoy delete it.
    pub fn on_done(&mut self) -> bool {
        if self.newest.get().0 == self.id {
            // Nobody exports after this one: what is held leaves now, if it can.
            with_mut(&self.pipeline, |p| p.flush_spans(&self.host, self.id));
        }
        with_mut(&self.telemetry, |telemetry| telemetry.flush(&self.host));
        let owed = self
            .pipeline
            .try_borrow()
            .map(|pipeline| pipeline.owed())
            .unwrap_or_default();
        if owed.fanouts > 0 {
            if self.newest.get().0 == self.id {
                // Nobody carries on after this one: Envoy is stopping, or the filter is gone.
                log::warn!(
                    "plugin retired with no newer configuration while this worker owes \
                     {owed}: it finishes them before it goes, unless Envoy is exiting, which \
                     loses them (drain it first: envoy/drain.sh)"
                );
            } else {
                log::info!(
                    "plugin retired by a newer configuration while this worker owes {owed}: \
                     the newer one carries them on"
                );
            }
        }
        self.retiring = self.owes_calls();
        if !self.retiring {
            with_mut(&self.pipeline, |p| p.forget_root(self.id));
        }
        !self.retiring
    }

    /// Whether a retired root (one whose `on_done` answered `false`) may now be deleted: its
    /// calls were all answered. True once; the glue then calls proxy-wasm's `done`.
    pub fn take_retired(&mut self) -> bool {
        if !self.retiring || self.retired || self.owes_calls() {
            return false;
        }
        self.retired = true;
        with_mut(&self.pipeline, |p| p.forget_root(self.id));
        log::info!("retired plugin: its last call was answered");
        true
    }

    /// This root's calls in flight, or, for the newest root (nobody carries on after it),
    /// anything still owed.
    fn owes_calls(&self) -> bool {
        self.pipeline.try_borrow().is_ok_and(|pipeline| {
            pipeline.open_calls_of(self.id) > 0
                || (self.newest.get().0 == self.id && pipeline.owed().fanouts > 0)
        })
    }

    /// What this worker still owes (the itemised `fanout.in_flight`).
    pub fn owed(&self) -> Owed {
        self.pipeline
            .try_borrow()
            .map(|pipeline| pipeline.owed())
            .unwrap_or_default()
    }

    /// A new request, with the configuration of now.
    pub fn create_stream(&self, context_id: u32) -> Stream<H> {
        Stream::new(
            context_id,
            self.id,
            self.host.clone(),
            self.config.clone(),
            self.counter(),
            self.pipeline.clone(),
        )
    }

    /// The timer the current configuration and the worker's pipeline need: the fastest
    /// period anything asks for (none: no timer).
    fn retune_timer(&mut self) {
        let config = self.config.as_deref();
        let pipeline = self.pipeline.try_borrow().map(|p| p.timer_needed(config));
        let needs = |wants: fn(&Config) -> bool| config.is_some_and(wants);
        let wanted = [
            // Borrowed elsewhere (never, in a root callback): as busy as it can be.
            pipeline.unwrap_or(Some(crate::pipeline::DELIVERY_TICK)),
            needs(|c| c.tracing.is_some()).then_some(TRACE_TICK),
            needs(|c| c.metrics).then_some(METRICS_FLUSH),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(Duration::ZERO);
        with_mut(&self.pipeline, |p| p.set_timer(&self.host, self.id, wanted));
        if self.newest.get().0 == self.id {
            self.newest.set((self.id, wanted != Duration::ZERO));
        }
    }

    /// Answers the streams whose fan-outs ended during a root callback.
    fn deliver(&self, finished: Vec<Finished>) {
        if finished.is_empty() {
            return;
        }
        let counter = self.counter();
        for done in finished {
            if let Some(stream) = done.answer_to {
                answer_stream(&self.host, &counter, stream, self.id, &done.answer);
            }
        }
    }

    /// How this root counts: into the VM's tally, unless its configuration turns metrics off.
    fn counter(&self) -> Counter {
        let metrics = self.config.as_ref().is_some_and(|c| c.metrics);
        Counter::new(metrics.then(|| self.telemetry.clone()))
    }
}
