//! Sources of truth. A source lists and watches Knative objects and hands each new
//! [`Listing`] (every object it has, and what it could not read) to the one loop all sources
//! share, [`run`]: it maps them ([`knative::map`]) and publishes a [`Snapshot`] each time
//! what they map to changes; the server decides what to serve from the latest one. The
//! directory source is the first; a live Kubernetes source is another implementation of
//! [`Source`].

use crate::knative;
use crate::model::{MapOptions, Problem, Snapshot};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// Where snapshots go: the server watches it.
pub type Snapshots = watch::Sender<Option<Arc<Snapshot>>>;

/// Where a source puts what it lists: the shared loop takes the latest (a listing that is
/// replaced before it is mapped is never mapped).
pub type Listings = watch::Sender<Option<Listing>>;

/// What a source has at one moment: every object (as `kubectl get -o json` prints one), and
/// what it could not read, named by file or object.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Listing {
    pub objects: Vec<Value>,
    pub problems: Vec<Problem>,
}

/// A source of truth: it lists and watches, and leaves the mapping to [`run`].
pub trait Source: Send + 'static {
    /// For logs and `--help`: what it reads.
    fn describe(&self) -> String;
    /// Put a [`Listing`] in `out` each time what the source has changes (the first at once),
    /// until `out` has no receiver left.
    fn run(self: Box<Self>, out: Listings) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Parse `--source`: `dir:PATH`.
pub fn from_arg(arg: &str) -> Result<Box<dyn Source>, String> {
    match arg.split_once(':') {
        Some(("dir", path)) if !path.is_empty() => {
            Ok(Box::new(DirSource::new(PathBuf::from(path))))
        }
        _ => Err(format!("--source {arg:?}: expected dir:PATH")),
    }
}

/// Run `source` and the loop every source shares: each listing mapped, and published on
/// `out` when what it maps to is not what was published last. Returns (and stops the
/// source) when `out` has no receiver left.
pub async fn run(source: Box<dyn Source>, options: MapOptions, out: Snapshots) {
    let describe = source.describe();
    let (listings_tx, mut listings) = watch::channel(None);
    let listing = tokio::spawn(source.run(listings_tx));
    let mut last: Option<Arc<Snapshot>> = None;
    loop {
        tokio::select! {
            changed = listings.changed() => if changed.is_err() { break },
            () = out.closed() => break,
        }
        let Some(listing) = listings.borrow_and_update().clone() else {
            continue;
        };
        // Mapping a thousand channels takes a while: not on the runtime's workers.
        let started = std::time::Instant::now();
        let mapped = tokio::task::spawn_blocking(move || mapped(&options, listing)).await;
        log::debug!("{describe}: mapped in {:?}", started.elapsed());
        let Ok(snapshot) = mapped else {
            break;
        };
        if last.as_deref() == Some(&snapshot) {
            continue;
        }
        log::info!(
            "{describe}: {} channel(s), {} with problems",
            snapshot.channels.len(),
            snapshot
                .channels
                .values()
                .filter(|c| !c.problems.is_empty())
                .count()
        );
        let snapshot = Arc::new(snapshot);
        if out.send(Some(snapshot.clone())).is_err() {
            break;
        }
        last = Some(snapshot);
    }
    listing.abort();
}

/// A listing mapped: the channels, and the source's own problems with the mapping's.
pub fn mapped(options: &MapOptions, listing: Listing) -> Snapshot {
    let mut snapshot = knative::map(options, listing.objects);
    snapshot.problems.extend(listing.problems);
    snapshot
}

/// A directory of Knative objects as `kubectl get -o yaml` (or `-o json`) writes them, one
/// or more per file (`*.yaml`, `*.yml`, `*.json`; names starting with `.` are skipped, so a
/// mounted ConfigMap's `..data` works). Read again whenever a file changes: an inotify watch
/// on the directory wakes the source at once (a file created, written, renamed or removed;
/// a burst of them is one read), and it looks every second anyway (every 100 ms where the
/// watch cannot be set). A file that does not parse is reported and its objects stay as
/// they last parsed (a half-written file never deletes a channel).
pub struct DirSource {
    dir: PathBuf,
    /// How often to look without a watch.
    interval: Duration,
    /// How often to look with one (a watch lost with a directory replaced).
    fallback: Duration,
    files: BTreeMap<String, (Vec<u8>, Vec<Value>)>,
}

impl DirSource {
    pub fn new(dir: PathBuf) -> DirSource {
        DirSource {
            dir,
            interval: Duration::from_millis(100),
            fallback: Duration::from_secs(1),
            files: BTreeMap::new(),
        }
    }

    /// Read the directory: what it lists, or None when nothing changed.
    pub fn poll(&mut self) -> Option<Listing> {
        let mut problems = Vec::new();
        let names = match list(&self.dir) {
            Ok(names) => names,
            Err(e) => {
                problems.push(Problem::new(
                    &self.dir.display().to_string(),
                    "",
                    format!("cannot list: {e}"),
                ));
                self.files.keys().cloned().collect()
            }
        };
        let mut changed = names.len() != self.files.len() || !problems.is_empty();
        let mut files = BTreeMap::new();
        for name in names {
            let previous = self.files.remove(&name);
            let bytes = match std::fs::read(self.dir.join(&name)) {
                Ok(bytes) => bytes,
                Err(e) => {
                    problems.push(Problem::new(&name, "", format!("cannot read: {e}")));
                    files.extend(previous.map(|p| (name, p)));
                    continue;
                }
            };
            let objects = match previous {
                Some((old, objects)) if old == bytes => objects,
                previous => {
                    changed = true;
                    parse(&bytes).unwrap_or_else(|e| {
                        let message = format!("not YAML or JSON: {e}");
                        problems.push(Problem::new(&name, "", message));
                        previous.map(|(_, objects)| objects).unwrap_or_default()
                    })
                }
            };
            files.insert(name, (bytes, objects));
        }
        self.files = files;
        crate::metrics::source_polled(problems.len(), changed);
        changed.then(|| Listing {
            objects: self
                .files
                .values()
                .flat_map(|(_, objects)| objects.iter().cloned())
                .collect(),
            problems,
        })
    }

    async fn watch_and_read(mut self, out: Listings) {
        let changes = Arc::new(Notify::new());
        let watcher = watch(&self.dir, changes.clone());
        let wait = if watcher.is_some() {
            self.fallback
        } else {
            self.interval
        };
        loop {
            // Reading files is blocking I/O: not on the runtime's workers.
            let read = tokio::task::spawn_blocking(move || {
                let listing = self.poll();
                (self, listing)
            })
            .await;
            let Ok((source, listing)) = read else {
                return;
            };
            self = source;
            log::debug!("{}: read, changed: {}", self.describe(), listing.is_some());
            let gone = match listing {
                Some(listing) => out.send(Some(listing)).is_err(),
                None => out.is_closed(),
            };
            if gone {
                return;
            }
            // A change wakes the source at once; the changes that come with it (a rename
            // over, a write in several parts) are read by the same look, once they stop.
            if tokio::time::timeout(wait, changes.notified()).await.is_ok() {
                settle(&changes).await;
            }
        }
    }
}

impl Source for DirSource {
    fn describe(&self) -> String {
        format!("dir:{}", self.dir.display())
    }

    fn run(self: Box<Self>, out: Listings) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(self.watch_and_read(out))
    }
}

/// How long a burst of changes must be quiet before the source reads, and the longest it
/// waits for that.
const QUIET: Duration = Duration::from_millis(20);
const SETTLE_AT_MOST: Duration = Duration::from_millis(200);

/// Wait until no change has come for [`QUIET`] (at most [`SETTLE_AT_MOST`]): a burst of
/// changes is one read.
async fn settle(changes: &Notify) {
    let deadline = tokio::time::Instant::now() + SETTLE_AT_MOST;
    while tokio::time::timeout(QUIET, changes.notified())
        .await
        .is_ok()
    {
        if tokio::time::Instant::now() >= deadline {
            return;
        }
    }
}

/// An inotify watch on `dir` that notifies `changes` at every change that can alter what
/// the source reads; None (logged) where it cannot be set: the source then looks every
/// 100 ms.
fn watch(dir: &Path, changes: Arc<Notify>) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let on_event = move |event: notify::Result<notify::Event>| {
        // An error (the kernel's queue overflowed, say) may hide a change: look again.
        let wake = match &event {
            Ok(event) => changes_content(&event.kind),
            Err(_) => true,
        };
        if wake {
            changes.notify_one();
        }
    };
    let watched = notify::recommended_watcher(on_event).and_then(|mut watcher| {
        watcher
            .watch(dir, notify::RecursiveMode::NonRecursive)
            .map(|()| watcher)
    });
    match watched {
        Ok(watcher) => Some(watcher),
        Err(e) => {
            log::warn!(
                "{}: no watch on the directory ({e}); looking every 100 ms",
                dir.display()
            );
            None
        }
    }
}

/// Whether an event can change what the source reads: a file created, written (or closed
/// after writing), renamed or removed. Not an open, a read or a close after reading (the
/// source's own reads make those: waking on them would read the directory in a loop), nor
/// a change of metadata only.
fn changes_content(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, ModifyKind};
    use notify::EventKind;
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(_)) => false,
        EventKind::Create(_) | EventKind::Modify(_) | EventKind::Remove(_) => true,
        EventKind::Any | EventKind::Other => true,
    }
}

fn list(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let wanted = [".yaml", ".yml", ".json"]
            .iter()
            .any(|ext| name.ends_with(ext));
        if wanted && !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Every Kubernetes object of a YAML (multi-document) or JSON file.
pub fn parse(bytes: &[u8]) -> Result<Vec<Value>, String> {
    let mut objects = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_slice(bytes) {
        let value = Value::deserialize(document).map_err(|e| e.to_string())?;
        knative::objects_of(value, &mut objects);
    }
    Ok(objects)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_can_change_a_file_wakes_the_source() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, DataChange, MetadataKind, ModifyKind, RemoveKind,
            RenameMode,
        };
        use notify::EventKind;
        let table = [
            (EventKind::Access(AccessKind::Open(AccessMode::Any)), false),
            (EventKind::Access(AccessKind::Read), false),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Read)),
                false,
            ),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Write)),
                true,
            ),
            (
                EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)),
                false,
            ),
            (EventKind::Create(CreateKind::File), true),
            (EventKind::Modify(ModifyKind::Data(DataChange::Any)), true),
            (EventKind::Modify(ModifyKind::Name(RenameMode::To)), true),
            (EventKind::Modify(ModifyKind::Name(RenameMode::From)), true),
            (EventKind::Remove(RemoveKind::File), true),
            (EventKind::Other, true),
        ];
        for (kind, wakes) in table {
            assert_eq!(changes_content(&kind), wakes, "{kind:?}");
        }
    }

    #[tokio::test]
    async fn a_burst_of_changes_is_one_read() {
        let changes = Notify::new();
        for _ in 0..5 {
            changes.notify_one();
        }
        settle(&changes).await;
        let again = tokio::time::timeout(Duration::from_millis(50), changes.notified()).await;
        assert!(again.is_err(), "the burst was taken whole");
    }

    #[test]
    fn a_file_that_stops_parsing_keeps_its_objects() {
        let dir =
            std::env::temp_dir().join(format!("fanout-control-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let channel = "apiVersion: messaging.knative.dev/v1\nkind: InMemoryChannel\nmetadata: {name: a, namespace: default}\n\
                       spec: {subscribers: [{subscriberUri: 'http://x.example/'}]}\n";
        std::fs::write(dir.join("a.yaml"), channel).unwrap();
        std::fs::write(dir.join(".hidden.yaml"), "{").unwrap();
        let mut source = DirSource::new(dir.clone());
        let mut poll = || {
            source
                .poll()
                .map(|listing| mapped(&MapOptions::default(), listing))
        };
        let first = poll().unwrap();
        assert_eq!(first.channels.len(), 1);
        assert!(first.problems.is_empty(), "{:?}", first.problems);
        assert_eq!(poll(), None);
        std::fs::write(dir.join("a.yaml"), "kind: [").unwrap();
        let broken = poll().unwrap();
        assert_eq!(broken.channels, first.channels);
        assert_eq!(broken.problems[0].object, "a.yaml");
        std::fs::remove_file(dir.join("a.yaml")).unwrap();
        assert!(poll().unwrap().channels.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The shared loop: a source's listings mapped, and one that maps to the same snapshot
    /// published once.
    #[tokio::test]
    async fn the_shared_loop_publishes_what_changed_once() {
        struct Listed(Vec<Listing>);
        impl Source for Listed {
            fn describe(&self) -> String {
                "listed".into()
            }
            fn run(self: Box<Self>, out: Listings) -> Pin<Box<dyn Future<Output = ()> + Send>> {
                Box::pin(async move {
                    for listing in self.0 {
                        let _ = out.send(Some(listing));
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    out.closed().await;
                })
            }
        }
        let channel = |uri: &str| {
            serde_json::json!({
                "apiVersion": "messaging.knative.dev/v1", "kind": "InMemoryChannel",
                "metadata": { "name": "a", "namespace": "default" },
                "spec": { "subscribers": [{ "subscriberUri": uri }] }
            })
        };
        let listing = |uri: &str| Listing {
            objects: vec![channel(uri)],
            problems: Vec::new(),
        };
        let listings = vec![
            listing("http://x.example/"),
            listing("http://x.example/"),
            listing("http://y.example/"),
        ];
        let (out, mut snapshots) = watch::channel(None);
        let server = tokio::spawn(run(Box::new(Listed(listings)), MapOptions::default(), out));
        let mut seen: Vec<String> = Vec::new();
        while seen.last().map(String::as_str) != Some("http://y.example/") {
            let changed = tokio::time::timeout(Duration::from_secs(10), snapshots.changed());
            changed.await.unwrap().unwrap();
            let snapshot = snapshots.borrow_and_update().clone().unwrap();
            seen.push(
                snapshot.channels["default/a"].spec.subscribers[0]
                    .uri
                    .clone(),
            );
        }
        assert!(seen.windows(2).all(|w| w[0] != w[1]), "{seen:?}");
        let more = tokio::time::timeout(Duration::from_millis(100), snapshots.changed()).await;
        assert!(more.is_err(), "the same snapshot is published once");
        drop(snapshots);
        server.await.unwrap();
    }
}
