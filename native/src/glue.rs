//! Each hook of Envoy's dynamic-module HTTP filter forwarded, as it comes, to the core's
//! [`Plugin`] (one per filter configuration per worker) or [`Stream`] (one per request),
//! as `src/filter/` does for proxy-wasm's contexts; the core decides and acts through
//! [`NativeHost`].
//!
//! Where the native ABI differs, the glue makes up for it here:
//! - metrics can only be defined while Envoy creates the configuration (`config_new`, main
//!   thread): a plugin is configured there once, to define them, then dropped; each worker
//!   configures its own plugin from the same bytes on its first stream, finding the ids;
//! - there is no timer: the plugin's tick (which hands the counts to Envoy's stats) runs at
//!   the end of a hook of one of its streams once its period has passed (the counts also go
//!   when the worker's last stream completes, else they would wait for its next one); while
//!   a retry waits, or a call waits for its slot (`max_concurrent_calls`), the process's
//!   timer thread (`timer.rs`) wakes the worker at the tick's period through a live stream's
//!   scheduler (`on_http_filter_scheduled`), even with no traffic, and the tick sends them.
//!   Such a call is its sender's stream's (`dispatch_serving`): that stream waits for it;
//! - a local reply sent to a stream may complete it (and call its hooks) before the call
//!   returns, even from inside that stream's own hook: what comes to a stream that is busy
//!   is kept and handled when its hook ends.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fanout::cell::with_mut;
use fanout::plugin::Plugin;
use fanout::stream::{Flow, Stream};
use hashbrown::HashMap;

use crate::abi::{ConfigDef, ConfigHandle, Filter, LentAnswer, Scheduler, CONTINUE, STOP};
use crate::host::HubLink;
use crate::host::{self, CallAnswer, Delivered, NativeConfig, NativeHost};
use crate::hub::{self, Relayed};
use crate::timer::TIMER;

/// The configurations Envoy holds: the timer thread stops with the last one.
static CONFIGS: AtomicUsize = AtomicUsize::new(0);

/// A worker's plugin of one configuration.
struct Worker {
    id: u32,
    plugin: RefCell<Plugin<NativeHost>>,
    /// When its tick is next due (ms).
    next_tick: Cell<u64>,
    /// The scheduler the timer wakes this worker through, and its stream (live: dropped
    /// when that stream goes).
    wake: RefCell<Option<(u32, Arc<Scheduler>)>>,
}

/// One request: Envoy holds it as the filter's module pointer. Served on its worker, or
/// relayed to its configuration's hub (`hub.rs`). Boxed whole (`filter_new`): the sizes of
/// its variants cost nothing more, and the worker's variant needs no second allocation.
#[allow(clippy::large_enum_variant)]
pub enum FilterModule {
    Local(FilterState),
    Relayed(Relayed),
}

/// One request served on its worker.
pub struct FilterState {
    id: u32,
    filter: Filter,
    max_body_bytes: u64,
    worker: Rc<Worker>,
    stream: RefCell<Stream<NativeHost>>,
    /// What came while the stream was busy (a hook of its own running).
    deferred: RefCell<Vec<Deferred>>,
    completed: Cell<bool>,
}

enum Deferred {
    Complete,
    Answer(u64, CallAnswer),
}

/// A worker's plugin of a configuration, and the configuration.
type WorkerOf = (Arc<NativeConfig>, Rc<Worker>);

thread_local! {
    /// This worker's plugins, by configuration id.
    static WORKERS: RefCell<HashMap<u32, WorkerOf>> = RefCell::new(HashMap::new());
}

/// The statuses the filter answers a request it refuses with: their counters are defined
/// with the configuration (the core names one the first time it is answered, later than
/// Envoy allows).
const REJECTED: &[u32] = &[400, 404, 405, 409, 413, 503];

pub fn program_init() {
    crate::log::install();
}

/// A configuration: validated, checked against what the native build serves, and its
/// metrics defined. `None` refuses it (the reason is logged, with its path).
pub fn config_new(
    def: &ConfigDef,
    handle: ConfigHandle,
    name: &[u8],
    bytes: &[u8],
) -> Option<Arc<NativeConfig>> {
    crate::log::follow_envoy();
    let config = match crate::serve::configure(bytes) {
        Ok(config) => config,
        Err(error) => {
            log::error!(
                "invalid plugin configuration for filter \"{}\": {error}",
                String::from_utf8_lossy(name)
            );
            return None;
        }
    };
    let mut native = NativeConfig::new(host::next_id(), bytes, config.max_body_bytes);
    native.body_wait_continue = config.body_wait == fanout::config::BodyWait::Continue;
    if crate::serve::needs_hub(&config) {
        native.envoy = Some(handle);
        native.hub = HubLink::new(handle);
        if native.hub.is_none() {
            log::error!("Envoy gave no scheduler for the configuration's own context");
            return None;
        }
    }
    if config.metrics {
        // A plugin configured here, once, defines them; the workers' plugins find them.
        let defining = Arc::new(NativeConfig::new(native.id, bytes, native.max_body_bytes));
        native.metrics = host::defining(def, || {
            let host = NativeHost::new(defining.clone(), 0);
            let mut plugin = Plugin::new(0, host.clone());
            plugin.on_configure();
            for status in REJECTED {
                let name = format!("fanout.requests.rejected.{status}");
                fanout::host::Host::define_metric(&host, fanout::metrics::Kind::Counter, &name);
            }
        });
    }
    let native = Arc::new(native);
    if native.hub.is_some() {
        hub::start(&native);
    }
    CONFIGS.fetch_add(1, Ordering::SeqCst);
    Some(native)
}

/// Envoy is done with a configuration (its streams may still run). With the last one the
/// timer thread stops: nothing commits to a scheduler after this.
pub fn config_destroy(config: &NativeConfig) {
    config.retired.store(true, Ordering::Relaxed);
    hub::stop(config);
    if CONFIGS.fetch_sub(1, Ordering::SeqCst) == 1 {
        TIMER.stop();
    }
}

/// This worker's plugin of `config`, configured on its first stream.
fn worker(config: &Arc<NativeConfig>) -> Option<Rc<Worker>> {
    let known = WORKERS.with(|w| {
        w.try_borrow()
            .ok()
            .and_then(|w| w.get(&config.id).map(|(_, worker)| worker.clone()))
    });
    if known.is_some() {
        return known;
    }
    let id = host::next_id();
    let mut plugin = Plugin::new(id, NativeHost::new(config.clone(), id));
    plugin.on_vm_start();
    if !plugin.on_configure() {
        return None;
    }
    let worker = Rc::new(Worker {
        id,
        plugin: RefCell::new(plugin),
        next_tick: Cell::new(host::now_ms()),
        wake: RefCell::new(None),
    });
    WORKERS.with(|w| {
        with_mut(w, |w| {
            // The plugins of configurations Envoy destroyed go once none of their streams
            // is left on this worker.
            w.retain(|_, (config, worker)| {
                !config.retired.load(Ordering::Relaxed) || Rc::strong_count(worker) > 1
            });
            w.insert(config.id, (config.clone(), worker.clone()));
        })
    });
    Some(worker)
}

pub fn filter_new(config: &Arc<NativeConfig>, filter: Filter) -> Option<Box<FilterModule>> {
    if config.hub.is_some() {
        return hub::relay_new(config, filter).map(|r| Box::new(FilterModule::Relayed(r)));
    }
    let worker = worker(config)?;
    let id = host::next_id();
    let stream = worker.plugin.try_borrow().ok()?.create_stream(id);
    host::live(id, filter, worker.id);
    Some(Box::new(FilterModule::Local(FilterState {
        id,
        filter,
        max_body_bytes: config.max_body_bytes,
        worker,
        stream: RefCell::new(stream),
        deferred: RefCell::new(Vec::new()),
        completed: Cell::new(false),
    })))
}

/// Runs `hook` on the stream, then what was deferred while it ran, then the plugin's tick if
/// it is due: with `filter` current throughout.
fn run<R>(
    state: &FilterState,
    filter: Filter,
    hook: impl FnOnce(&mut Stream<NativeHost>) -> R,
) -> Option<R> {
    let saved = host::enter(filter);
    let result = with_mut(&state.stream, hook);
    if result.is_some() {
        after_hook(state);
    }
    host::leave(saved);
    result
}

/// What follows a hook of the stream (its filter current): what was deferred while it ran,
/// the plugin's tick if it is due, and the counts if the worker's last stream is over.
fn after_hook(state: &FilterState) {
    drain(state);
    keep_time(&state.worker);
    if state.completed.get() && host::stream_of(state.worker.id).is_none() {
        // Completed here, or by a local reply inside the hook: no hook may come to the
        // worker for long, and the counts waiting for one would not reach Envoy's stats
        // until then. They go now, through this stream.
        with_mut(&state.worker.plugin, Plugin::flush_metrics);
    }
}

/// What came while the stream's own hook ran.
fn drain(state: &FilterState) {
    loop {
        let next = with_mut(&state.deferred, |d| d.pop()).flatten();
        match next {
            None => break,
            Some(Deferred::Complete) => {
                with_mut(&state.stream, |s| s.on_done());
            }
            Some(Deferred::Answer(callout, answer)) => {
                deliver(state, callout, Delivered::Kept(answer));
            }
        }
    }
}

fn defer(state: &FilterState, event: Deferred) {
    with_mut(&state.deferred, |d| d.insert(0, event));
}

/// The plugin's tick if it is due, then the timer's next wake-up if a retry or a call waits.
fn keep_time(worker: &Worker) {
    let period = host::tick_period(worker.id);
    host::tick_if_due(&worker.next_tick, &worker.plugin, period);
    arm(worker, period);
}

fn status(flow: Flow) -> u32 {
    match flow {
        Flow::Continue => CONTINUE,
        Flow::Pause => STOP,
    }
}

pub fn request_headers(state: &FilterState, filter: Filter, end_of_stream: bool) -> u32 {
    host::room_for_body(filter, state.max_body_bytes);
    run(state, filter, |s| {
        status(s.on_request_headers(end_of_stream))
    })
    .unwrap_or(STOP)
}

pub fn request_body(state: &FilterState, filter: Filter, end_of_stream: bool) -> u32 {
    let size = filter.request_body_size();
    run(state, filter, |s| {
        status(s.on_request_body(size, end_of_stream))
    })
    .unwrap_or(STOP)
}

pub fn request_trailers(state: &FilterState, filter: Filter) -> u32 {
    run(state, filter, |s| status(s.on_request_trailers())).unwrap_or(STOP)
}

pub fn response_headers(state: &FilterState, filter: Filter) -> u32 {
    run(state, filter, |s| status(s.on_response_headers())).unwrap_or(CONTINUE)
}

/// The stream is over: nobody answers it any more; the core learns it (now, or when the
/// stream's running hook ends).
pub fn stream_complete(state: &FilterState, filter: Filter) {
    if state.completed.replace(true) {
        return;
    }
    host::gone(state.id, filter);
    let wake = forget_wake(state);
    if run(state, filter, |s| s.on_done()).is_none() {
        defer(state, Deferred::Complete);
    }
    drop(wake);
}

/// The answer to a call of this stream (Envoy's, for this hook).
pub fn callout_done(state: &FilterState, filter: Filter, callout: u64, answer: LentAnswer<'_>) {
    let saved = host::enter(filter);
    if state.stream.try_borrow().is_ok() {
        deliver(state, callout, Delivered::Lent(answer));
        after_hook(state);
    } else {
        // Inside the stream's own hook (an answer Envoy gave at dispatch): once it ends, so
        // copied.
        defer(state, Deferred::Answer(callout, CallAnswer::of(&answer)));
    }
    host::leave(saved);
}

/// An answer handed to the core: the call's token, then the answer as the call answer
/// being delivered.
fn deliver(state: &FilterState, callout: u64, answer: Delivered<'_>) {
    let Some(token) = host::take_token(state.filter, callout) else {
        log::debug!("[#{}] an answer to a call nobody waits for", state.id);
        return;
    };
    host::with_answer(answer, |headers, body| {
        with_mut(&state.stream, |s| s.on_call_response(token, headers, body))
    });
}

/// Envoy is done with the filter. Its stream learns it, if Envoy never completed it.
pub fn destroy(state: Box<FilterModule>) {
    match *state {
        FilterModule::Local(state) => destroy_local(&state),
        FilterModule::Relayed(relayed) => hub::over(&relayed),
    }
}

fn destroy_local(state: &FilterState) {
    if !state.completed.get() {
        host::gone(state.id, state.filter);
        let wake = forget_wake(state);
        let saved = host::detached();
        with_mut(&state.stream, |s| s.on_done());
        arm(&state.worker, host::tick_period(state.worker.id));
        host::leave(saved);
        drop(wake);
    }
}

/// The stream is going: if the timer wakes its worker through it, no more (the timer may
/// still hold the scheduler; whoever drops it last deletes it). Returned, to be dropped once
/// the stream's last hook is over.
fn forget_wake(state: &FilterState) -> Option<(u32, Arc<Scheduler>)> {
    let worker = &state.worker;
    let mine = worker
        .wake
        .try_borrow()
        .is_ok_and(|w| w.as_ref().is_some_and(|(id, _)| *id == state.id));
    if mine {
        with_mut(&worker.wake, Option::take).flatten()
    } else {
        None
    }
}

/// While the plugin has a retry waiting, or a call waiting for its slot, asks the timer to
/// wake this worker when its tick is due (the tick sends them), through the scheduler of one
/// of its live streams (a sync sender waits for its calls, so one is live; none left:
/// nothing is owed).
fn arm(worker: &Worker, period: Duration) {
    // Either makes the core ask for its delivery tick: a slower period (the metrics'
    // second) or none is the common case, decided without looking further.
    if period.is_zero() || period > fanout::pipeline::DELIVERY_TICK {
        return;
    }
    let waiting = worker.plugin.try_borrow().is_ok_and(|p| {
        let owed = p.owed();
        owed.retrying > 0 || owed.queued > 0
    });
    if !waiting {
        return;
    }
    let Some(scheduler) = wake_handle(worker) else {
        return;
    };
    let wait = worker.next_tick.get().saturating_sub(host::now_ms());
    let at = Instant::now() + Duration::from_millis(wait);
    TIMER.wake_at(at, u64::from(worker.id), scheduler);
}

/// The scheduler the timer wakes `worker` through: the one it has, if its stream is live,
/// else a new one of a live stream of the worker.
fn wake_handle(worker: &Worker) -> Option<Arc<Scheduler>> {
    let kept = worker.wake.try_borrow().ok().and_then(|w| {
        w.as_ref()
            .filter(|(id, _)| host::is_live(*id))
            .map(|(_, s)| s.clone())
    });
    if kept.is_some() {
        return kept;
    }
    let (stream, filter) = host::stream_of(worker.id)?;
    let scheduler = filter.scheduler()?;
    let old = with_mut(&worker.wake, |w| w.replace((stream, scheduler.clone())));
    drop(old);
    Some(scheduler)
}

/// The timer's wake-up (`event`: the plugin's id) came to this stream: that plugin's tick
/// runs now, with this stream current, then the next wake-up is asked for.
pub fn scheduled(state: &FilterState, filter: Filter, event: u64) {
    let worker = if u64::from(state.worker.id) == event {
        Some(state.worker.clone())
    } else {
        WORKERS.with(|w| {
            w.try_borrow().ok().and_then(|w| {
                w.values()
                    .find(|(_, worker)| u64::from(worker.id) == event)
                    .map(|(_, worker)| worker.clone())
            })
        })
    };
    let Some(worker) = worker else {
        return;
    };
    let saved = host::enter(filter);
    worker.next_tick.set(0);
    let period = host::tick_period(worker.id);
    host::tick_if_due(&worker.next_tick, &worker.plugin, period);
    arm(&worker, period);
    host::leave(saved);
}
