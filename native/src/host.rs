//! [`NativeHost`]: the core's [`Host`] calls, performed through Envoy's dynamic-module ABI
//! (`abi.rs`'s safe handles), and the worker's tables they need: which filter the calls act
//! for (`enter`/`leave`, `set_effective_context`), the live streams by the core's context
//! id, the calls in flight by their filter and Envoy's callout id (Envoy numbers a stream's
//! callouts from 1; the core wants one token space per worker), the call answer being
//! delivered, and the plugin's timer period; and what they share with the glue: a filter
//! configuration (`NativeConfig`) and a call's answer (`CallAnswer`).

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fanout::answer::Answer;
use fanout::call::Failure;
use fanout::cell::with_mut;
use fanout::headers::HeaderMap;
use fanout::host::{CasMismatch, Host};
use fanout::metrics::Kind;
use hashbrown::HashMap;

use fanout::plugin::Plugin;

use crate::abi::{ConfigDef, ConfigHandle, Filter, LentAnswer, MetricKind, Scheduler};
use crate::shared::CasStore;
use crate::timer::Wake;

/// Envoy's shared data, as the wasm build has it: one store for the process.
static SHARED: LazyLock<CasStore> = LazyLock::new(CasStore::new);

/// A metric id as the core holds it: the kind in the top two bits, Envoy's id below.
const KIND_SHIFT: u32 = 30;
const ID_MASK: u32 = (1 << KIND_SHIFT) - 1;

/// A filter configuration, shared by the main thread and the workers: its JSON and the ids
/// of the metrics defined for it.
pub struct NativeConfig {
    pub id: u32,
    pub bytes: Vec<u8>,
    pub metrics: HashMap<String, u32>,
    pub max_body_bytes: u64,
    /// Envoy destroyed it (a configuration update replaced it): once no stream of a worker
    /// uses it, that worker's plugin of it goes.
    pub retired: AtomicBool,
    /// `body_wait: continue`: the request's headers go on to the buffer filter after this one.
    pub body_wait_continue: bool,
    /// Envoy's configuration, for its hub's calls and metrics (main thread).
    pub envoy: Option<ConfigHandle>,
    /// The way to its hub, when it is served there (`hub.rs`).
    pub hub: Option<HubLink>,
}

impl NativeConfig {
    pub fn new(id: u32, bytes: &[u8], max_body_bytes: u64) -> Self {
        NativeConfig {
            id,
            bytes: bytes.to_vec(),
            metrics: HashMap::new(),
            max_body_bytes,
            retired: AtomicBool::new(false),
            body_wait_continue: false,
            envoy: None,
            hub: None,
        }
    }
}

/// A call's answer, copied out of Envoy's hook: every header's name and value in one
/// buffer, each header a span of it, and the body. The worker's answers are copied into one
/// such copy, reused (`with_answer`): no allocation per call once it has room.
#[derive(Default)]
pub struct CallAnswer {
    text: Vec<u8>,
    /// Where each name starts, where its value starts (the name ends there) and ends.
    headers: Vec<(usize, usize, usize)>,
    body: Vec<u8>,
    /// The trailers, as the headers (a streamed call's only: a one-shot call has none).
    trailers: Vec<(usize, usize, usize)>,
}

impl CallAnswer {
    const EMPTY: CallAnswer = CallAnswer {
        text: Vec::new(),
        headers: Vec::new(),
        body: Vec::new(),
        trailers: Vec::new(),
    };

    /// A copy of `answer` (one that must outlive its hook).
    pub fn of(answer: &LentAnswer<'_>) -> CallAnswer {
        let mut copy = CallAnswer::default();
        copy.copy(answer);
        copy
    }

    /// `answer` copied in place of what this held, in the room it has.
    fn copy(&mut self, answer: &LentAnswer<'_>) {
        self.text.clear();
        self.headers.clear();
        self.body.clear();
        self.trailers.clear();
        self.append(answer);
    }

    /// A streamed call's part (its headers, or a body chunk) added to what came before.
    pub fn append(&mut self, part: &LentAnswer<'_>) {
        for (name, value) in part.headers() {
            let span = self.keep(name, value);
            self.headers.push(span);
        }
        for chunk in part.chunks() {
            self.body.extend_from_slice(chunk);
        }
    }

    /// A streamed call's trailers (`part`'s headers).
    pub fn append_trailers(&mut self, part: &LentAnswer<'_>) {
        for (name, value) in part.headers() {
            let span = self.keep(name, value);
            self.trailers.push(span);
        }
    }

    fn keep(&mut self, name: &[u8], value: &[u8]) -> (usize, usize, usize) {
        let name_start = self.text.len();
        self.text.extend_from_slice(name);
        let value_start = self.text.len();
        self.text.extend_from_slice(value);
        (name_start, value_start, self.text.len())
    }

    fn headers(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.spans(&self.headers)
    }

    fn spans<'a>(
        &'a self,
        spans: &'a [(usize, usize, usize)],
    ) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
        spans.iter().filter_map(|&(name, value, end)| {
            Some((self.text.get(name..value)?, self.text.get(value..end)?))
        })
    }

    /// The value of the first header named `name` (any case).
    fn header(&self, name: &str) -> Option<&[u8]> {
        find(self.headers(), name)
    }

    /// The value of the first trailer named `name` (any case).
    fn trailer(&self, name: &str) -> Option<&[u8]> {
        find(self.spans(&self.trailers), name)
    }
}

fn find<'a>(mut pairs: impl Iterator<Item = (&'a [u8], &'a [u8])>, name: &str) -> Option<&'a [u8]> {
    pairs
        .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
        .map(|(_, value)| value)
}

/// The answer `deliver` is given: Envoy's own, in the hook it came with, or a copy of it.
pub enum Delivered<'a> {
    Lent(LentAnswer<'a>),
    Kept(CallAnswer),
}

/// The most bytes of an answer's copy a worker keeps for the next answer.
const SPARE_ROOM: usize = 64 << 10;

thread_local! {
    /// The filter whose hook is running on this worker.
    static HOOK: Cell<Option<Filter>> = const { Cell::new(None) };
    /// The filter the host calls act for: the hook's, or the stream the core answers from
    /// it (`set_effective_context`).
    static CURRENT: Cell<Option<Filter>> = const { Cell::new(None) };
    /// The worker's live streams by context id, with their plugin's id.
    static LIVE: RefCell<HashMap<u32, (Filter, u32)>> = RefCell::new(HashMap::new());
    /// The worker's calls in flight: (filter, Envoy's callout id) → the core's token.
    static CALLOUTS: RefCell<HashMap<(Filter, u64), u32>> = RefCell::new(HashMap::new());
    static NEXT_TOKEN: Cell<u32> = const { Cell::new(0) };
    /// The call answer being delivered (`call_status`, `call_body`, ...).
    static ANSWER: RefCell<Option<CallAnswer>> = const { RefCell::new(None) };
    /// The last delivered answer's copy, whose room the next one reuses.
    static SPARE: RefCell<CallAnswer> = const { RefCell::new(CallAnswer::EMPTY) };
    /// Each plugin's timer period (the core's `set_tick_period`), by plugin id.
    static TICKS: RefCell<HashMap<u32, Duration>> = RefCell::new(HashMap::new());
    /// The metrics found undefined on this worker (said once each).
    static UNDEFINED: RefCell<std::collections::HashSet<String>> =
        RefCell::new(std::collections::HashSet::new());
    /// During `config_new` (main thread): the configuration defining its metrics, and what
    /// it defined, by name.
    static DEFINING: RefCell<Option<(ConfigDef, HashMap<String, u32>)>> =
        const { RefCell::new(None) };
}

/// The host one plugin and its streams call: a configuration's metric ids and bytes; a
/// worker's, or the configuration's hub's on the main thread (`hub.rs`: the request, the
/// calls, the answers and the metrics are the hub's there).
#[derive(Clone)]
pub struct NativeHost {
    config: Arc<NativeConfig>,
    plugin: u32,
    hub: bool,
}

impl NativeHost {
    pub fn new(config: Arc<NativeConfig>, plugin: u32) -> Self {
        NativeHost {
            config,
            plugin,
            hub: false,
        }
    }

    /// The host of a configuration's hub.
    pub fn hub(config: Arc<NativeConfig>, plugin: u32) -> Self {
        NativeHost {
            config,
            plugin,
            hub: true,
        }
    }

    fn update_metric(&self, kind: MetricKind, id: u32, delta: i64) {
        let id = (id & ID_MASK) as usize;
        if self.hub {
            if let Some(envoy) = self.config.envoy {
                envoy.update_metric(kind, id, delta);
            }
        } else if let Some(filter) = current() {
            filter.update_metric(kind, id, delta);
        }
    }
}

/// Which filters were current before a hook began, for [`leave`].
pub struct Saved(Option<Filter>, Option<Filter>);

/// A hook of `filter` begins: the host calls act for it.
pub fn enter(filter: Filter) -> Saved {
    let saved = Saved(HOOK.with(|h| h.replace(Some(filter))), CURRENT.get());
    CURRENT.set(Some(filter));
    saved
}

/// Work for no filter (a filter Envoy destroyed without completing its stream): the host
/// calls act for nobody until [`leave`].
pub fn detached() -> Saved {
    let saved = Saved(HOOK.with(|h| h.replace(None)), CURRENT.get());
    CURRENT.set(None);
    saved
}

/// The hook ends: what was current before it (an outer hook it ran inside) is again.
pub fn leave(saved: Saved) {
    HOOK.set(saved.0);
    CURRENT.set(saved.1);
}

/// A stream of plugin `plugin` the core may answer, or call for, from another one's hook.
pub fn live(id: u32, filter: Filter, plugin: u32) {
    LIVE.with(|l| with_mut(l, |l| l.insert(id, (filter, plugin))));
}

/// The live stream `id`'s filter.
fn live_filter(id: u32) -> Option<Filter> {
    LIVE.with(|l| {
        l.try_borrow()
            .ok()
            .and_then(|l| l.get(&id).map(|(f, _)| *f))
    })
}

/// Whether stream `id` is live.
pub fn is_live(id: u32) -> bool {
    live_filter(id).is_some()
}

/// A live stream of plugin `plugin` on this worker, if one is.
pub fn stream_of(plugin: u32) -> Option<(u32, Filter)> {
    LIVE.with(|l| {
        l.try_borrow().ok().and_then(|l| {
            l.iter()
                .find(|(_, (_, p))| *p == plugin)
                .map(|(id, (filter, _))| (*id, *filter))
        })
    })
}

/// The stream completed or is gone: nobody answers it any more, its calls are forgotten.
pub fn gone(id: u32, filter: Filter) {
    LIVE.with(|l| with_mut(l, |l| l.remove(&id)));
    CALLOUTS.with(|c| with_mut(c, |c| c.retain(|(f, _), _| *f != filter)));
}

/// The core's token of the call `callout` of `filter`, forgotten (its answer came).
pub fn take_token(filter: Filter, callout: u64) -> Option<u32> {
    CALLOUTS
        .with(|c| with_mut(c, |c| c.remove(&(filter, callout))))
        .flatten()
}

/// Runs `deliver` with `answer` as the call answer being delivered, given its number of
/// headers and its body's size. Envoy's own answer is copied into the room of the last one.
pub fn with_answer<R>(answer: Delivered<'_>, deliver: impl FnOnce(usize, usize) -> R) -> R {
    let answer = match answer {
        Delivered::Kept(kept) => kept,
        Delivered::Lent(lent) => {
            let mut copy = SPARE
                .with(|s| with_mut(s, std::mem::take))
                .unwrap_or_default();
            copy.copy(&lent);
            copy
        }
    };
    let (headers, body) = (answer.headers.len(), answer.body.len());
    let outer = ANSWER
        .with(|a| with_mut(a, |a| a.replace(answer)))
        .flatten();
    let result = deliver(headers, body);
    let done = ANSWER
        .with(|a| with_mut(a, |a| std::mem::replace(a, outer)))
        .flatten();
    // A large answer's room is not kept: a worker holds at most this much for the next.
    if let Some(done) = done.filter(|d| d.text.capacity() + d.body.capacity() <= SPARE_ROOM) {
        SPARE.with(|s| with_mut(s, |s| *s = done));
    }
    result
}

/// A plugin's timer period (zero: none).
pub fn tick_period(plugin: u32) -> Duration {
    TICKS
        .with(|t| t.try_borrow().ok().and_then(|t| t.get(&plugin).copied()))
        .unwrap_or_default()
}

/// Runs `define` (the main-thread plugin's configure) with `def` defining the metrics, and
/// returns the ids defined, by name.
pub fn defining(def: &ConfigDef, define: impl FnOnce()) -> HashMap<String, u32> {
    DEFINING.with(|d| with_mut(d, |d| *d = Some((*def, HashMap::new()))));
    define();
    DEFINING
        .with(|d| with_mut(d, Option::take))
        .flatten()
        .map(|(_, ids)| ids)
        .unwrap_or_default()
}

/// Context ids for plugins, streams and configurations: one space for the process.
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

pub fn next_id() -> u32 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// The plugin's tick, when its period has passed (the timer Envoy's ABI does not have):
/// it hands the counts to Envoy's stats, and sends the retries due (`next_tick`: when it is
/// due, ms).
pub fn tick_if_due(next_tick: &Cell<u64>, plugin: &RefCell<Plugin<NativeHost>>, period: Duration) {
    let now = now_ms();
    if period.is_zero() || now < next_tick.get() {
        return;
    }
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
    next_tick.set(now.saturating_add(period_ms));
    with_mut(plugin, Plugin::on_tick);
}

/// Envoy answers 413 itself past the stream's buffer limit (1 MiB by default): room for
/// `max_body_bytes`, so that the filter's own 413 is the one the sender gets.
pub fn room_for_body(filter: Filter, max_body_bytes: u64) {
    let wanted = max_body_bytes.saturating_add(1 << 20);
    if filter.buffer_limit() < wanted {
        filter.set_buffer_limit(wanted);
    }
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    since_epoch().as_millis() as u64
}

fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// `read` of the call answer being delivered; `None` if there is none.
fn answering<R>(read: impl FnOnce(&CallAnswer) -> Option<R>) -> Option<R> {
    ANSWER.with(|a| read(a.try_borrow().ok()?.as_ref()?))
}

fn current() -> Option<Filter> {
    CURRENT.get()
}

fn kind_of(id: u32) -> MetricKind {
    match id >> KIND_SHIFT {
        0 => MetricKind::Counter,
        1 => MetricKind::Gauge,
        _ => MetricKind::Histogram,
    }
}

impl Host for NativeHost {
    fn follow_log_level(&self) {
        crate::log::follow_envoy();
    }

    fn plugin_configuration(&self) -> Option<Vec<u8>> {
        Some(self.config.bytes.clone())
    }

    fn request_headers(&self) -> HeaderMap {
        if self.hub {
            return hub_headers();
        }
        current().map(Filter::request_headers).unwrap_or_default()
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        if self.hub {
            return hub_request_body(size);
        }
        let mut body = current().map(Filter::request_body).unwrap_or_default();
        body.truncate(size);
        body
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        if self.hub {
            let owner = hub_current_context(self.plugin);
            return hub_dispatch(&self.config, owner, cluster, &headers, body, timeout);
        }
        let Some(filter) = current() else {
            return Err(Failure::DispatchError {
                detail: "no stream to make the call from".to_string(),
            });
        };
        call_from(filter, cluster, &headers, body, timeout)
    }

    /// A call for a sync sender is its stream's callout (a retry sent from the worker's
    /// tick too), so that its answer comes to that stream; refused if the sender left.
    fn dispatch_serving(
        &self,
        stream: Option<u32>,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        let Some(stream) = stream else {
            return self.dispatch(cluster, headers, body, timeout);
        };
        if self.hub {
            if !hub_is_stream(stream) {
                return Err(Failure::DispatchError {
                    detail: "the sender left: no stream to call for".to_string(),
                });
            }
            return hub_dispatch(&self.config, stream, cluster, &headers, body, timeout);
        }
        let Some(filter) = live_filter(stream) else {
            return Err(Failure::DispatchError {
                detail: "the sender left: no stream to make the call from".to_string(),
            });
        };
        call_from(filter, cluster, &headers, body, timeout)
    }

    fn dispatch_for(
        &self,
        context_id: u32,
        cluster: &str,
        headers: Vec<(&str, &[u8])>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, Failure> {
        if self.hub {
            return hub_dispatch(&self.config, context_id, cluster, &headers, body, timeout);
        }
        // A configuration that makes one is served by its hub (`serve::needs_hub`).
        Err(Failure::DispatchError {
            detail: format!(
                "a worker's plugin has no context of its own to call \"{cluster}\" from \
                 (its configuration is served by its hub)"
            ),
        })
    }

    fn call_status(&self) -> Option<u16> {
        // Read in place: every answer's status is read.
        answering(|a| std::str::from_utf8(a.header(":status")?).ok()?.parse().ok())
    }

    fn call_body(&self, max: usize) -> Vec<u8> {
        answering(|a| Some(a.body.get(..max).unwrap_or(&a.body).to_vec())).unwrap_or_default()
    }

    fn call_header(&self, name: &str) -> Option<String> {
        answering(|a| String::from_utf8(a.header(name)?.to_vec()).ok())
    }

    fn call_headers(&self) -> Vec<(String, Vec<u8>)> {
        answering(|a| {
            Some(
                a.headers()
                    .map(|(name, value)| {
                        (String::from_utf8_lossy(name).into_owned(), value.to_vec())
                    })
                    .collect(),
            )
        })
        .unwrap_or_default()
    }

    fn call_trailer(&self, name: &str) -> Option<String> {
        // A streamed call's (the hub's); Envoy's one-shot callouts carry none.
        answering(|a| String::from_utf8(a.trailer(name)?.to_vec()).ok())
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        if self.hub {
            return hub_set_effective_context(context_id, self.plugin);
        }
        match live_filter(context_id) {
            Some(filter) => {
                CURRENT.set(Some(filter));
                true
            }
            None => {
                CURRENT.set(HOOK.get());
                false
            }
        }
    }

    fn respond(&self, answer: &Answer) {
        if self.hub {
            return hub_respond(answer);
        }
        let Some(filter) = current() else {
            log::warn!("fanout: no stream to answer {} to", answer.status);
            return;
        };
        send_answer(filter, answer);
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn now_nanos(&self) -> u64 {
        u64::try_from(since_epoch().as_nanos()).unwrap_or(u64::MAX)
    }

    fn define_metric(&self, kind: Kind, name: &str) -> Option<u32> {
        let defined = DEFINING.with(|d| {
            with_mut(d, |d| {
                let (def, ids) = d.as_mut()?;
                if let Some(&id) = ids.get(name) {
                    return Some(id);
                }
                let (abi_kind, tag) = match kind {
                    Kind::Counter => (MetricKind::Counter, 0),
                    Kind::Gauge => (MetricKind::Gauge, 1),
                    Kind::Histogram => (MetricKind::Histogram, 2),
                };
                let id = u32::try_from(def.define(abi_kind, name)?).ok()?;
                let id = (tag << KIND_SHIFT) | (id & ID_MASK);
                ids.insert(name.to_string(), id);
                Some(id)
            })
            .flatten()
        });
        // On a worker: what `config_new` defined (Envoy defines no metric after it).
        let id = defined.or_else(|| self.config.metrics.get(name).copied());
        if id.is_none() {
            not_counted(name);
        }
        id
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        self.update_metric(kind_of(id), id, delta);
    }

    fn record_metric(&self, id: u32, value: u64) {
        let value = i64::try_from(value).unwrap_or(i64::MAX);
        self.update_metric(MetricKind::Histogram, id, value);
    }

    fn set_tick_period(&self, period: Duration) {
        TICKS.with(|t| with_mut(t, |t| t.insert(self.plugin, period)));
    }

    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        SHARED.get(key)
    }

    fn set_shared_data(
        &self,
        key: &str,
        value: &[u8],
        cas: Option<u32>,
    ) -> Result<(), CasMismatch> {
        SHARED.set(key, value, cas)
    }
}

/// Sends the core's answer to `filter`'s sender.
pub fn send_answer(filter: Filter, answer: &Answer) {
    let headers: Vec<(&str, &[u8])> = answer
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_bytes()))
        .collect();
    filter.send_response(answer.status, &headers, &answer.body, "fanout");
}

/// A new token for a call (one space for the thread's calls).
pub fn next_token() -> u32 {
    NEXT_TOKEN.with(|t| {
        let next = t.get().wrapping_add(1).max(1);
        t.set(next);
        next
    })
}

/// A call from `filter`: the core's token for it.
fn call_from(
    filter: Filter,
    cluster: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
    timeout: Duration,
) -> Result<u32, Failure> {
    let callout = filter
        .callout(cluster, headers, body, timeout)
        .map_err(|code| refused(cluster, code))?;
    let token = next_token();
    CALLOUTS.with(|c| with_mut(c, |c| c.insert((filter, callout), token)));
    Ok(token)
}

/// Says once per worker that the metric `name` is not counted: the core names it after
/// Envoy took the configuration, when a module can no longer define one.
fn not_counted(name: &str) {
    let first = UNDEFINED
        .with(|u| with_mut(u, |u| u.insert(name.to_string())))
        .unwrap_or(false);
    if first {
        log::warn!(
            "the metric {name} was not defined when Envoy took the configuration (the \
             native build can define metrics only then): it is not counted"
        );
    }
}

/// How Envoy refused a call at dispatch (`envoy_dynamic_module_type_http_callout_init_result`).
pub fn refused(cluster: &str, code: u32) -> Failure {
    let why = match code {
        1 => "MissingRequiredHeaders",
        2 => {
            return Failure::DispatchError {
                detail: format!(
                    "Envoy refused the call (ClusterNotFound): is \"{cluster}\" a cluster \
                     Envoy knows?"
                ),
            }
        }
        3 => "DuplicateCalloutId",
        // Envoy's async client gives no request back when it failed the call inline: when the
        // cluster's circuit breaker is full (a cluster with no endpoint at all fails the same
        // way, and the two cannot be told apart here), as the wasm build's InternalFailure.
        4 => {
            return fanout::call::overflow(
                cluster,
                "refused at dispatch, CannotCreateRequest; or the cluster has no endpoint",
            )
        }
        _ => "unknown result",
    };
    Failure::DispatchError {
        detail: format!("Envoy refused the call ({why}, {code})"),
    }
}

// ---------------------------------------------------------------------------------------
// What a configuration served by its hub shares between threads (`hub.rs`).

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
    wake: Arc<Scheduler>,
}

/// The event a configuration's scheduler carries (one kind: the hub's turn).
const HUB_TURN: u64 = 0;
/// The event a relayed stream's scheduler carries: the hub's answer is there.
const ANSWERED: u64 = 0;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Relay {
    /// A request relayed by a worker's filter, woken through `wake` (its stream's).
    pub fn new(wake: Arc<Scheduler>) -> Relay {
        Relay {
            id: next_id(),
            answer: Mutex::new(None),
            wake,
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// The hub's answer, once (the worker's side).
    pub fn take_answer(&self) -> Option<Answer> {
        lock(&self.answer).take()
    }
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
    pub fn post(&self, relay: &Arc<Relay>, event: Event) {
        let first = {
            let mut inbox = lock(&self.inbox);
            inbox.push((relay.clone(), event));
            inbox.len() == 1
        };
        if first {
            self.wake.commit(HUB_TURN);
        }
    }

    /// The events posted since the last take (the hub's side).
    pub fn take(&self) -> Vec<(Arc<Relay>, Event)> {
        std::mem::take(&mut *lock(&self.inbox))
    }

    /// The scheduler that wakes the hub.
    pub fn wake(&self) -> Arc<Scheduler> {
        self.wake.clone()
    }
}

/// A call of a hub in flight.
pub struct HubCall {
    pub token: u32,
    /// The context its answer goes to: a stream, or the plugin.
    pub owner: u32,
    pub answer: CallAnswer,
}

/// A relayed request, as the hub's host reads it.
struct Request {
    relay: Arc<Relay>,
    headers: HeaderMap,
    body: Vec<u8>,
}

thread_local! {
    /// The relayed requests, by stream id.
    static HUB_REQUESTS: RefCell<HashMap<u32, Request>> = RefCell::new(HashMap::new());
    /// The stream whose event the hub handles.
    static HUB_HOOK: Cell<Option<u32>> = const { Cell::new(None) };
    /// The stream the host calls act for; `None`: the plugin.
    static HUB_CURRENT: Cell<Option<u32>> = const { Cell::new(None) };
    /// The hubs' calls in flight: (configuration id, Envoy's stream id) → (the core's
    /// token, the context its answer goes to), and the answer as it comes.
    static HUB_CALLS: RefCell<HashMap<(u32, u64), HubCall>> = RefCell::new(HashMap::new());
    /// The relayed requests answered, for the hub to be done with them after its turn.
    static HUB_ANSWERED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

// ---------------------------------------------------------------------------------------
// The hub's tables and host calls (main thread): the relayed requests, the stream the
// calls act for, the calls in flight.

fn with_request<R>(read: impl FnOnce(&Request) -> R) -> Option<R> {
    let id = HUB_CURRENT.get()?;
    HUB_REQUESTS.with(|r| r.try_borrow().ok()?.get(&id).map(read))
}

pub fn hub_headers() -> HeaderMap {
    with_request(|r| r.headers.clone()).unwrap_or_default()
}

pub fn hub_request_body(size: usize) -> Vec<u8> {
    with_request(|r| r.body.get(..size).unwrap_or(&r.body).to_vec()).unwrap_or_default()
}

/// The context a call made now answers to: the current stream, else the plugin.
pub fn hub_current_context(plugin: u32) -> u32 {
    HUB_CURRENT.get().unwrap_or(plugin)
}

/// Whether `id` is a relayed request the hub still serves.
pub fn hub_is_stream(id: u32) -> bool {
    HUB_REQUESTS.with(|r| r.try_borrow().is_ok_and(|r| r.contains_key(&id)))
}

/// A call of the configuration's, its answer for context `owner`: the core's token.
pub fn hub_dispatch(
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
    // A one-shot call's body goes with its length; a stream's would go chunked unless it
    // says its length (as the one-shot call Envoy makes for a worker).
    let (length, mut sized);
    let headers = if body.is_empty()
        || headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-length"))
    {
        headers
    } else {
        length = body.len().to_string();
        sized = Vec::with_capacity(headers.len() + 1);
        sized.extend_from_slice(headers);
        sized.push(("content-length", length.as_bytes()));
        &sized[..]
    };
    let stream = handle
        .start_call(cluster, headers, body, timeout)
        .map_err(|code| refused(cluster, code))?;
    let token = next_token();
    let call = HubCall {
        token,
        owner,
        answer: CallAnswer::default(),
    };
    HUB_CALLS.with(|c| with_mut(c, |c| c.insert((config.id, stream), call)));
    Ok(token)
}

pub fn hub_set_effective_context(context_id: u32, plugin: u32) -> bool {
    if context_id == plugin {
        HUB_CURRENT.set(None);
        true
    } else if hub_is_stream(context_id) {
        HUB_CURRENT.set(Some(context_id));
        true
    } else {
        HUB_CURRENT.set(HUB_HOOK.get());
        false
    }
}

/// Answers the current stream: its worker sends it.
pub fn hub_respond(answer: &Answer) {
    let Some(relay) = with_request(|r| r.relay.clone()) else {
        log::warn!("fanout: no stream to answer {} to", answer.status);
        return;
    };
    *lock(&relay.answer) = Some(answer.clone());
    relay.wake.commit(ANSWERED);
    HUB_ANSWERED.with(|a| with_mut(a, |a| a.push(relay.id)));
}

/// The relayed requests answered since the last call: the hub is done with them (their
/// workers tell it nothing more).
pub fn hub_take_answered() -> Vec<u32> {
    HUB_ANSWERED
        .with(|a| with_mut(a, std::mem::take))
        .unwrap_or_default()
}

/// A request relayed to the hub, with its headers: the hub's until [`hub_forget`].
pub fn hub_relayed(relay: Arc<Relay>, headers: HeaderMap) {
    let id = relay.id;
    let request = Request {
        relay,
        headers,
        body: Vec::new(),
    };
    HUB_REQUESTS.with(|r| with_mut(r, |r| r.insert(id, request)));
}

/// The whole body of relayed request `id`.
pub fn hub_body(id: u32, body: Vec<u8>) {
    HUB_REQUESTS.with(|r| {
        with_mut(r, |r| {
            if let Some(request) = r.get_mut(&id) {
                request.body = body;
            }
        })
    });
}

/// The relayed request `id` is over.
pub fn hub_forget(id: u32) {
    HUB_REQUESTS.with(|r| with_mut(r, |r| r.remove(&id)));
}

/// Runs `work` with the hub's calls acting for stream `stream` (`None`: the plugin), its
/// event the one handled.
pub fn hub_acting<R>(stream: Option<u32>, work: impl FnOnce() -> R) -> R {
    let hook = stream.map(|id| HUB_HOOK.replace(Some(id)));
    let saved = HUB_CURRENT.replace(stream);
    let result = work();
    HUB_CURRENT.set(saved);
    if let Some(hook) = hook {
        HUB_HOOK.set(hook);
    }
    result
}

/// A part of a hub call's answer (headers or a body chunk; `trailers`: its trailers).
pub fn hub_call_part(config: u32, stream: u64, part: &LentAnswer<'_>, trailers: bool) {
    HUB_CALLS.with(|c| {
        with_mut(c, |c| {
            if let Some(call) = c.get_mut(&(config, stream)) {
                if trailers {
                    call.answer.append_trailers(part);
                } else {
                    call.answer.append(part);
                }
            }
        })
    });
}

/// The call `stream` of configuration `config`, over: taken from the calls in flight.
pub fn hub_take_call(config: u32, stream: u64) -> Option<HubCall> {
    HUB_CALLS
        .with(|c| with_mut(c, |c| c.remove(&(config, stream))))
        .flatten()
}

/// Every call in flight of configuration `config`, taken: their tokens.
pub fn hub_take_calls_of(config: u32) -> Vec<u32> {
    HUB_CALLS
        .with(|c| {
            with_mut(c, |c| {
                let keys: Vec<(u32, u64)> =
                    c.keys().filter(|(id, _)| *id == config).copied().collect();
                keys.iter()
                    .filter_map(|key| c.remove(key).map(|call| call.token))
                    .collect()
            })
        })
        .unwrap_or_default()
}
