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
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use fanout::answer::Answer;
use fanout::call::Failure;
use fanout::cell::with_mut;
use fanout::headers::HeaderMap;
use fanout::plugin::{Plugin, VmShared};
use fanout::stream::Stream;
use hashbrown::HashMap;

use crate::abi::{ConfigHandle, ConfigScheduler, Filter, LentAnswer, Scheduler, CONTINUE, STOP};
use crate::glue::{self, TIMER};
use crate::host::{self, CallAnswer, Delivered, NativeConfig, NativeHost};
use crate::timer::Wake;

/// What a worker's filter tells the hub of its request, in the order Envoy gave it.
pub enum Event {
    /// The request's headers, and whether they end it.
    Headers(HeaderMap, bool),
    /// The body's size so far and whether it ends the request; with the whole body when it
    /// does.
    Body(Option<Vec<u8>>, usize, bool),
    /// Trailers: they end the request; the whole body.
    Trailers(Vec<u8>),
    /// A response came back through the filter that the hub did not send.
    Responded,
    /// The stream is over (answered, or its client left).
    Gone,
}

/// A request relayed to the hub, shared by its worker's filter and the hub: where the hub's
/// answer waits for the worker, and how the worker is woken to send it.
pub struct Relay {
    /// The request's stream id (the core's context id, one space for the process).
    id: u32,
    answer: Mutex<Option<Answer>>,
    wake: Arc<Scheduler>,
}

/// A configuration's way to its hub: the events the workers post, and the scheduler that
/// wakes the main thread for them.
pub struct HubLink {
    inbox: Mutex<Vec<(Arc<Relay>, Event)>>,
    wake: Arc<ConfigScheduler>,
}

/// The event a configuration's scheduler carries (one kind: the hub's turn).
const HUB_TURN: u64 = 0;
/// The event a relayed stream's scheduler carries: the hub's answer is there.
const ANSWERED: u64 = 0;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HubLink {
    /// The link of configuration `handle` (in `config_new`, main thread).
    pub fn new(handle: ConfigHandle) -> Option<HubLink> {
        Some(HubLink {
            inbox: Mutex::new(Vec::new()),
            wake: handle.scheduler()?,
        })
    }

    /// Posts an event; the first one since the hub took the inbox wakes it.
    fn post(&self, relay: &Arc<Relay>, event: Event) {
        let first = {
            let mut inbox = lock(&self.inbox);
            inbox.push((relay.clone(), event));
            inbox.len() == 1
        };
        if first {
            self.wake.commit(HUB_TURN);
        }
    }
}

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
        relay: Arc::new(Relay {
            id: glue::next_id(),
            answer: Mutex::new(None),
            wake: filter.scheduler()?,
        }),
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
    glue::room_for_body(filter, state.config.max_body_bytes);
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

/// The stream is over (completed, or destroyed without completing): the hub learns it once.
pub fn over(state: &Relayed) {
    if !state.over.replace(true) {
        post(state, Event::Gone);
    }
}

/// The hub's answer is there (the relay's scheduler): it goes to the sender.
pub fn relay_scheduled(state: &Relayed, filter: Filter) {
    let answer = lock(&state.relay.answer).take();
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

/// A call of a hub in flight.
struct Call {
    token: u32,
    /// The context its answer goes to: a stream, or the plugin.
    owner: u32,
    answer: CallAnswer,
}

/// A relayed request, as the hub's host reads it.
struct Request {
    relay: Arc<Relay>,
    headers: HeaderMap,
    body: Vec<u8>,
}

thread_local! {
    /// The hubs of the configurations Envoy holds, by configuration id (main thread).
    static HUBS: RefCell<HashMap<u32, Rc<Hub>>> = RefCell::new(HashMap::new());
    /// The relayed requests, by stream id.
    static REQUESTS: RefCell<HashMap<u32, Request>> = RefCell::new(HashMap::new());
    /// The stream whose event the hub handles.
    static HOOK: Cell<Option<u32>> = const { Cell::new(None) };
    /// The stream the host calls act for; `None`: the plugin.
    static CURRENT: Cell<Option<u32>> = const { Cell::new(None) };
    /// The hubs' calls in flight: (configuration id, Envoy's stream id) → (the core's
    /// token, the context its answer goes to), and the answer as it comes.
    static CALLOUTS: RefCell<HashMap<(u32, u64), Call>> = RefCell::new(HashMap::new());
}

/// Starts the hub of `config` (in `config_new`, main thread). Its plugin is configured on
/// its first request, when Envoy's clusters are there (the etcd store calls its cluster
/// as it is configured; at `config_new` the main thread may have none yet).
pub fn start(config: &Arc<NativeConfig>) {
    let id = glue::next_id();
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
    let cancelled: Vec<u32> = CALLOUTS
        .with(|c| {
            with_mut(c, |c| {
                let keys: Vec<(u32, u64)> = c
                    .keys()
                    .filter(|(config, _)| *config == hub.config.id)
                    .copied()
                    .collect();
                keys.iter()
                    .filter_map(|key| c.remove(key).map(|call| call.token))
                    .collect()
            })
        })
        .unwrap_or_default();
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
            let saved = CURRENT.replace(None);
            with_mut(&answering.plugin, |p| {
                p.on_call_response(token, headers, body)
            });
            CURRENT.set(saved);
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
    REQUESTS.with(|r| with_mut(r, |r| ids.iter().for_each(|id| drop(r.remove(id)))));
    if let Some(newest) = newest.as_deref() {
        keep_time(newest);
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
        let events = std::mem::take(&mut *lock(&link.inbox));
        if !events.is_empty() {
            configure(&hub);
        }
        for (relay, event) in events {
            handle(&hub, relay, event);
        }
    }
    keep_time(&hub);
}

fn handle(hub: &Hub, relay: Arc<Relay>, event: Event) {
    let id = relay.id;
    match event {
        Event::Headers(headers, end_of_stream) => {
            let Some(stream) = hub.plugin.try_borrow().ok().map(|p| p.create_stream(id)) else {
                return;
            };
            let request = Request {
                relay,
                headers,
                body: Vec::new(),
            };
            REQUESTS.with(|r| with_mut(r, |r| r.insert(id, request)));
            with_mut(&hub.streams, |s| {
                s.insert(id, Rc::new(RefCell::new(stream)))
            });
            run(hub, id, |s| {
                let _ = s.on_request_headers(end_of_stream);
            });
        }
        Event::Body(body, size, end_of_stream) => {
            if let Some(body) = body {
                keep_body(id, body);
            }
            run(hub, id, |s| {
                let _ = s.on_request_body(size, end_of_stream);
            });
        }
        Event::Trailers(body) => {
            keep_body(id, body);
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
            REQUESTS.with(|r| with_mut(r, |r| r.remove(&id)));
        }
    }
}

fn keep_body(id: u32, body: Vec<u8>) {
    REQUESTS.with(|r| {
        with_mut(r, |r| {
            if let Some(request) = r.get_mut(&id) {
                request.body = body;
            }
        })
    });
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
    let saved = (HOOK.replace(Some(id)), CURRENT.replace(Some(id)));
    with_mut(&stream, hook);
    HOOK.set(saved.0);
    CURRENT.set(saved.1);
}

/// A part of the answer to a call of the hub of `config` (its headers, a body chunk, its
/// trailers: `on_http_filter_config_http_stream_*`), kept until the answer is complete.
pub fn call_part(config: &NativeConfig, stream: u64, part: LentAnswer<'_>, trailers: bool) {
    CALLOUTS.with(|c| {
        with_mut(c, |c| {
            if let Some(call) = c.get_mut(&(config.id, stream)) {
                if trailers {
                    call.answer.append_trailers(&part);
                } else {
                    call.answer.append(&part);
                }
            }
        })
    });
}

/// The call is over (`on_http_filter_config_http_stream_complete`, or `_reset`: then
/// `complete` is false and the answer is none, a failed call as a one-shot call's reset):
/// its answer goes to the context that made it.
pub fn call_done(config: &NativeConfig, stream: u64, complete: bool) {
    sweep();
    let Some(hub) = hub_of(config.id) else {
        return;
    };
    let Some(call) = CALLOUTS
        .with(|c| with_mut(c, |c| c.remove(&(config.id, stream))))
        .flatten()
    else {
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
    let owner = if is_stream(call.owner) {
        call.owner
    } else {
        hub.id
    };
    host::with_answer(Delivered::Kept(answer), |headers, body| {
        if owner == hub.id {
            let saved = CURRENT.replace(None);
            with_mut(&hub.plugin, |p| p.on_call_response(token, headers, body));
            CURRENT.set(saved);
        } else {
            run(&hub, owner, |s| s.on_call_response(token, headers, body));
        }
    });
    keep_time(&hub);
}

/// The plugin's tick if it is due, then the timer's next wake-up of the hub while the
/// plugin has a period.
fn keep_time(hub: &Hub) {
    glue::tick_if_due(&hub.next_tick, &hub.plugin, host::tick_period(hub.id));
    if host::tick_period(hub.id).is_zero() {
        return;
    }
    let Some(link) = &hub.config.hub else {
        return;
    };
    let wait = hub.next_tick.get().saturating_sub(host::now_ms());
    let at = Instant::now() + Duration::from_millis(wait);
    let handle: Arc<dyn Wake> = link.wake.clone();
    TIMER.wake_at(at, u64::from(hub.id), handle);
}

// ---------------------------------------------------------------------------------------
// The hub's host calls (`NativeHost` of a hub forwards them here).

fn with_request<R>(read: impl FnOnce(&Request) -> R) -> Option<R> {
    let id = CURRENT.get()?;
    REQUESTS.with(|r| r.try_borrow().ok()?.get(&id).map(read))
}

pub fn relayed_headers() -> HeaderMap {
    with_request(|r| r.headers.clone()).unwrap_or_default()
}

pub fn relayed_body(size: usize) -> Vec<u8> {
    with_request(|r| r.body.get(..size).unwrap_or(&r.body).to_vec()).unwrap_or_default()
}

/// The context a call made now answers to: the current stream, else the plugin.
pub fn current_context(plugin: u32) -> u32 {
    CURRENT.get().unwrap_or(plugin)
}

/// Whether `id` is a relayed request the hub still serves.
pub fn is_stream(id: u32) -> bool {
    REQUESTS.with(|r| r.try_borrow().is_ok_and(|r| r.contains_key(&id)))
}

/// A call of the configuration's, its answer for context `owner`: the core's token.
pub fn dispatch(
    config: &NativeConfig,
    owner: u32,
    cluster: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
    timeout: Duration,
) -> Result<u32, Failure> {
    let Some(handle) = config
        .envoy
        .filter(|_| !config.retired.load(Ordering::Relaxed))
    else {
        return Err(Failure::DispatchError {
            detail: "the configuration was replaced: no context to make the call from".to_string(),
        });
    };
    let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    // A one-shot call's body goes with its length; a stream's would go chunked unless it
    // says its length (as the one-shot call Envoy makes for a worker).
    let length = body.len().to_string();
    let mut sized;
    let headers = if body.is_empty()
        || headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-length"))
    {
        headers
    } else {
        sized = Vec::with_capacity(headers.len() + 1);
        sized.extend_from_slice(headers);
        sized.push(("content-length", length.as_bytes()));
        &sized[..]
    };
    let stream = handle
        .start_call(cluster, headers, body, timeout_ms)
        .map_err(|code| host::refused(cluster, code))?;
    let token = host::next_token();
    let call = Call {
        token,
        owner,
        answer: CallAnswer::default(),
    };
    CALLOUTS.with(|c| with_mut(c, |c| c.insert((config.id, stream), call)));
    Ok(token)
}

pub fn set_effective_context(context_id: u32, plugin: u32) -> bool {
    if context_id == plugin {
        CURRENT.set(None);
        true
    } else if is_stream(context_id) {
        CURRENT.set(Some(context_id));
        true
    } else {
        CURRENT.set(HOOK.get());
        false
    }
}

/// Answers the current stream: its worker sends it.
pub fn respond(answer: &Answer) {
    let Some(relay) = with_request(|r| r.relay.clone()) else {
        log::warn!("fanout: no stream to answer {} to", answer.status);
        return;
    };
    *lock(&relay.answer) = Some(answer.clone());
    relay.wake.commit(ANSWERED);
}
