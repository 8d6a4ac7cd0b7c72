//! A configuration's own context, on Envoy's main thread: the hub. What proxy-wasm's root
//! context gives the wasm build (work after the sender's answer, or for no sender: async
//! deliveries, best-effort subscribers, the etcd store's settles and leases, the spans'
//! batches) needs a context that outlives every request; Envoy's dynamic-module HTTP filter
//! has one per configuration, on the main thread, with its own calls
//! (`..._config_http_callout`) and its own scheduler. A configuration that asks for any of
//! those is served there, whole, by one core [`Plugin`] (`serve::needs_hub`):
//!
//! - a worker's filter relays its request to the hub ([`Event`]: headers, body, trailers,
//!   an answer that came from elsewhere, the stream's end), through the configuration's
//!   inbox and scheduler; it waits, paused, for the hub's answer;
//! - the hub runs the core's [`Stream`] of that request as the worker would, its host
//!   reading the relayed request (`request_headers`, `request_body`); every call is the
//!   configuration's, its answer delivered to the context that made it (the stream, or the
//!   plugin); an answer for the sender goes back to the worker ([`Relay`]) through its
//!   stream's scheduler, which sends it;
//! - the plugin's tick runs when due at the end of each hub event, and the process's timer
//!   thread wakes the hub through the configuration's scheduler while it has a period.
//!
//! Envoy holds a configuration while any of its streams lives, so a relayed request always
//! finds its hub. Everything here runs on the main thread except the worker's side
//! ([`Relayed`]), which only posts events and sends answers.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fanout::cell::with_mut;
use fanout::plugin::{Plugin, VmShared};
use fanout::stream::Stream;
use hashbrown::HashMap;

use crate::abi::{Filter, LentAnswer, CONTINUE, STOP};
use crate::host::{self, CallAnswer, Delivered, Event, NativeConfig, NativeHost, Relay};
use crate::timer::{Wake, TIMER};

// ---------------------------------------------------------------------------------------
// The worker's side: a filter relaying its request.

/// A stream of a configuration served by its hub: Envoy holds it as the filter's module
/// pointer.
pub struct Relayed {
    relay: Arc<Relay>,
    config: Arc<NativeConfig>,
    /// The hub's answer was sent to the sender.
    answered: Cell<bool>,
    /// The hub was told the stream is over.
    over: Cell<bool>,
}

pub fn relay_new(config: &Arc<NativeConfig>, filter: Filter) -> Option<Relayed> {
    Some(Relayed {
        relay: Arc::new(Relay::new(filter.scheduler()?)),
        config: config.clone(),
        answered: Cell::new(false),
        over: Cell::new(false),
    })
}

fn post(state: &Relayed, event: Event) {
    if let Some(link) = &state.config.hub {
        link.post(&state.relay, event);
    }
}

pub fn request_headers(state: &Relayed, filter: Filter, end_of_stream: bool) -> u32 {
    host::room_for_body(filter, state.config.max_body_bytes);
    post(
        state,
        Event::Headers(filter.request_headers(), end_of_stream),
    );
    // `body_wait: continue`: the headers go on to the buffer filter that must follow.
    if !end_of_stream && state.config.body_wait_continue {
        CONTINUE
    } else {
        STOP
    }
}

pub fn request_body(state: &Relayed, filter: Filter, end_of_stream: bool) -> u32 {
    let size = filter.request_body_size();
    let body = end_of_stream.then(|| filter.request_body());
    post(state, Event::Body(body, size, end_of_stream));
    STOP
}

pub fn request_trailers(state: &Relayed, filter: Filter) -> u32 {
    post(state, Event::Trailers(filter.request_body()));
    STOP
}

pub fn response_headers(state: &Relayed) -> u32 {
    if !state.answered.get() && !state.over.get() {
        post(state, Event::Responded);
    }
    CONTINUE
}

/// The stream is over (completed, or destroyed without completing): the hub learns it once,
/// unless it answered it (it is done with it then: one wake-up of the main thread less per
/// request).
pub fn over(state: &Relayed) {
    if !state.over.replace(true) && !state.answered.get() {
        post(state, Event::Gone);
    }
}

/// The hub's answer is there (the relay's scheduler): it goes to the sender.
pub fn relay_scheduled(state: &Relayed, filter: Filter) {
    let answer = state.relay.take_answer();
    if let Some(answer) = answer {
        if !state.over.get() && !state.answered.replace(true) {
            host::send_answer(filter, &answer);
        }
    }
}

// ---------------------------------------------------------------------------------------
// The main thread's side: the hub.

/// A configuration's hub.
struct Hub {
    config: Arc<NativeConfig>,
    /// Its plugin's id.
    id: u32,
    plugin: RefCell<Plugin<NativeHost>>,
    streams: RefCell<HashMap<u32, Rc<RefCell<Stream<NativeHost>>>>>,
    /// When its tick is next due (ms).
    next_tick: Cell<u64>,
    /// Its plugin was configured (on its first turn).
    configured: Cell<bool>,
}

thread_local! {
    /// The hubs of the configurations Envoy holds, by configuration id (main thread).
    static HUBS: RefCell<HashMap<u32, Rc<Hub>>> = RefCell::new(HashMap::new());
}

/// Starts the hub of `config` (in `config_new`, main thread). Its plugin is configured on
/// its first request, when Envoy's clusters are there (the etcd store calls its cluster
/// as it is configured; at `config_new` the main thread may have none yet).
pub fn start(config: &Arc<NativeConfig>) {
    let id = host::next_id();
    // The hubs share one pipeline, as a wasm VM's root contexts do: what a replaced
    // configuration's hub owed, the newest one carries on.
    let host = NativeHost::hub(config.clone(), id);
    let plugin = Plugin::with_shared(id, host, VmShared::of_this_vm());
    let hub = Rc::new(Hub {
        config: config.clone(),
        id,
        plugin: RefCell::new(plugin),
        streams: RefCell::new(HashMap::new()),
        next_tick: Cell::new(host::now_ms()),
        configured: Cell::new(false),
    });
    HUBS.with(|h| {
        with_mut(h, |h| {
            h.insert(config.id, hub);
        })
    });
}

/// The plugin configured, on the hub's first request (the configuration was validated by
/// `config_new` already: a plugin that refuses it answers its requests 503).
fn configure(hub: &Hub) {
    if hub.configured.replace(true) {
        return;
    }
    with_mut(&hub.plugin, |p| {
        p.on_vm_start();
        p.on_configure()
    });
}

/// Envoy is done with `config`: on the main thread its hub goes now (no stream of it is
/// left: each holds the configuration). Destroyed on a worker (its last stream ended there),
/// it goes on the main thread's next turn of any hub ([`sweep`]).
pub fn stop(config: &NativeConfig) {
    let hub = HUBS
        .with(|h| with_mut(h, |h| h.remove(&config.id)))
        .flatten();
    if let Some(hub) = hub {
        retire(&hub);
    }
}

/// The hubs of configurations Envoy destroyed on a worker, retired.
fn sweep() {
    let retired: Vec<Rc<Hub>> = HUBS
        .with(|h| {
            with_mut(h, |h| {
                let ids: Vec<u32> = h
                    .iter()
                    .filter(|(_, hub)| hub.config.retired.load(Ordering::Relaxed))
                    .map(|(id, _)| *id)
                    .collect();
                ids.iter().filter_map(|id| h.remove(id)).collect()
            })
        })
        .unwrap_or_default();
    retired.iter().for_each(|hub| retire(hub));
}

/// A hub whose configuration Envoy destroyed. Envoy cancels that configuration's calls
/// (the ABI has no way to keep it until they are answered, as proxy-wasm keeps a retired
/// root context): each call in flight is answered as one with no response, to the newest
/// hub's plugin if there is one, so that the shared pipeline retries it where the
/// subscriber's delivery allows, dead-letters or counts it; said once, with how many.
fn retire(hub: &Hub) {
    let cancelled = host::hub_take_calls_of(hub.config.id);
    let newest = HUBS.with(|h| {
        h.try_borrow()
            .ok()
            .and_then(|h| h.values().max_by_key(|hub| hub.id).cloned())
    });
    if !cancelled.is_empty() {
        log::warn!(
            "a replaced configuration's {} call(s) in flight are cancelled by Envoy with it \
             (the native build cannot keep it until they are answered): they count as calls \
             with no response, and are retried, or dead-lettered, as their subscriber's delivery says{}",
            cancelled.len(),
            if newest.is_some() { "" } else { "; no newer configuration carries them on" }
        );
    }
    if let Some(newest) = newest.as_deref() {
        // It takes over now, not on its first request.
        configure(newest);
    }
    let answering = newest.as_deref().unwrap_or(hub);
    for token in cancelled {
        host::with_answer(Delivered::Kept(CallAnswer::default()), |headers, body| {
            host::hub_acting(None, || {
                with_mut(&answering.plugin, |p| {
                    p.on_call_response(token, headers, body)
                })
            });
        });
    }
    with_mut(&hub.plugin, |p| {
        if !p.on_done() {
            p.take_retired();
        }
    });
    let ids: Vec<u32> = hub
        .streams
        .try_borrow()
        .map(|s| s.keys().copied().collect())
        .unwrap_or_default();
    ids.into_iter().for_each(host::hub_forget);
    match newest.as_deref() {
        Some(newest) => keep_time(newest),
        None => done_with_answered(),
    }
}

fn hub_of(config: u32) -> Option<Rc<Hub>> {
    HUBS.with(|h| h.try_borrow().ok()?.get(&config).cloned())
}

/// The hub's turn (`on_http_filter_config_scheduled`): the events posted, in order, then
/// the tick if it is due.
pub fn scheduled(config: &NativeConfig) {
    sweep();
    let Some(hub) = hub_of(config.id) else {
        return;
    };
    if let Some(link) = &config.hub {
        let events = link.take();
        if !events.is_empty() {
            configure(&hub);
        }
        for (relay, event) in events {
            handle(&hub, relay, event);
        }
    }
    keep_time(&hub);
}

/// The streams the hubs answered during this turn end on the hub's side now: their workers
/// send the answer and tell the hub nothing more (`over`).
fn done_with_answered() {
    for id in host::hub_take_answered() {
        let hub = HUBS.with(|h| {
            h.try_borrow().ok().and_then(|h| {
                h.values()
                    .find(|hub| hub.streams.try_borrow().is_ok_and(|s| s.contains_key(&id)))
                    .cloned()
            })
        });
        if let Some(hub) = hub {
            run(&hub, id, |s| {
                s.on_done();
            });
            with_mut(&hub.streams, |s| s.remove(&id));
        }
        host::hub_forget(id);
    }
}

fn handle(hub: &Hub, relay: Arc<Relay>, event: Event) {
    let id = relay.id();
    match event {
        Event::Headers(headers, end_of_stream) => {
            let Some(stream) = hub.plugin.try_borrow().ok().map(|p| p.create_stream(id)) else {
                return;
            };
            host::hub_relayed(relay, headers);
            with_mut(&hub.streams, |s| {
                s.insert(id, Rc::new(RefCell::new(stream)))
            });
            run(hub, id, |s| {
                let _ = s.on_request_headers(end_of_stream);
            });
        }
        Event::Body(body, size, end_of_stream) => {
            if let Some(body) = body {
                host::hub_body(id, body);
            }
            run(hub, id, |s| {
                let _ = s.on_request_body(size, end_of_stream);
            });
        }
        Event::Trailers(body) => {
            host::hub_body(id, body);
            run(hub, id, |s| {
                let _ = s.on_request_trailers();
            });
        }
        Event::Responded => run(hub, id, |s| {
            let _ = s.on_response_headers();
        }),
        Event::Gone => {
            run(hub, id, |s| {
                s.on_done();
            });
            with_mut(&hub.streams, |s| s.remove(&id));
            host::hub_forget(id);
        }
    }
}

/// Runs `hook` on the hub's stream `id` (if it still has it), with it current.
fn run(hub: &Hub, id: u32, hook: impl FnOnce(&mut Stream<NativeHost>)) {
    let stream = hub
        .streams
        .try_borrow()
        .ok()
        .and_then(|s| s.get(&id).cloned());
    let Some(stream) = stream else {
        return;
    };
    host::hub_acting(Some(id), || with_mut(&stream, hook));
}

/// A part of the answer to a call of the hub of `config` (its headers, a body chunk, its
/// trailers: `on_http_filter_config_http_stream_*`), kept until the answer is complete.
pub fn call_part(config: &NativeConfig, stream: u64, part: LentAnswer<'_>, trailers: bool) {
    host::hub_call_part(config.id, stream, &part, trailers);
}

/// The call is over (`on_http_filter_config_http_stream_complete`, or `_reset`: then
/// `complete` is false and the answer is none, a failed call as a one-shot call's reset):
/// its answer goes to the context that made it.
pub fn call_done(config: &NativeConfig, stream: u64, complete: bool) {
    sweep();
    let Some(hub) = hub_of(config.id) else {
        return;
    };
    let Some(call) = host::hub_take_call(config.id, stream) else {
        log::debug!("an answer to a call of the hub nobody waits for");
        return;
    };
    let answer = if complete {
        call.answer
    } else {
        CallAnswer::default()
    };
    let token = call.token;
    // A call of a stream that is over (a best-effort delivery after the sender's answer, a
    // call its client left) goes on with the plugin, as a call the root made.
    let owner = if host::hub_is_stream(call.owner) {
        call.owner
    } else {
        hub.id
    };
    host::with_answer(Delivered::Kept(answer), |headers, body| {
        if owner == hub.id {
            host::hub_acting(None, || {
                with_mut(&hub.plugin, |p| p.on_call_response(token, headers, body))
            });
        } else {
            run(&hub, owner, |s| s.on_call_response(token, headers, body));
        }
    });
    keep_time(&hub);
}

/// The end of the hub's turn: the plugin's tick if it is due, the streams answered done
/// with, then the timer's next wake-up of the hub while the plugin has a period.
fn keep_time(hub: &Hub) {
    host::tick_if_due(&hub.next_tick, &hub.plugin, host::tick_period(hub.id));
    done_with_answered();
    if host::tick_period(hub.id).is_zero() {
        return;
    }
    let Some(link) = &hub.config.hub else {
        return;
    };
    let wait = hub.next_tick.get().saturating_sub(host::now_ms());
    let at = Instant::now() + Duration::from_millis(wait);
    let handle: Arc<dyn Wake> = link.wake();
    TIMER.wake_at(at, u64::from(hub.id), handle);
}
