//! Sources of truth. A source runs for as long as the server does and publishes a
//! [`Snapshot`] (channels mapped, with their problems) each time what it says changes; the
//! server decides what to serve from the latest one. The directory source is the first; a
//! live Kubernetes source is another implementation of [`Source`].

use crate::knative;
use crate::model::{MapOptions, Problem, Snapshot};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Where snapshots go: the server watches it.
pub type Snapshots = watch::Sender<Option<Arc<Snapshot>>>;

/// A source of truth.
pub trait Source: Send + 'static {
    /// For logs and `--help`: what it reads.
    fn describe(&self) -> String;
    /// Publish snapshots until `out` has no receiver left. Runs on its own thread: a source
    /// may block.
    fn run(self: Box<Self>, out: Snapshots);
}

/// Parse `--source`: `dir:PATH`.
pub fn from_arg(arg: &str, options: MapOptions) -> Result<Box<dyn Source>, String> {
    match arg.split_once(':') {
        Some(("dir", path)) if !path.is_empty() => {
            Ok(Box::new(DirSource::new(PathBuf::from(path), options)))
        }
        _ => Err(format!("--source {arg:?}: expected dir:PATH")),
    }
}

/// A directory of Knative objects as `kubectl get -o yaml` (or `-o json`) writes them, one
/// or more per file (`*.yaml`, `*.yml`, `*.json`; names starting with `.` are skipped, so a
/// mounted ConfigMap's `..data` works). Read again whenever a file changes: an inotify watch
/// on the directory wakes the source at once, and it looks every second anyway (every 100 ms
/// where the watch cannot be set). A file that does
/// not parse is reported and its objects stay as they last parsed (a half-written file never
/// deletes a channel).
pub struct DirSource {
    dir: PathBuf,
    /// How often to look without a watch.
    interval: Duration,
    /// How often to look with one (a watch lost with a directory replaced).
    fallback: Duration,
    files: BTreeMap<String, (Vec<u8>, Vec<Value>)>,
    options: MapOptions,
}

impl DirSource {
    pub fn new(dir: PathBuf, options: MapOptions) -> DirSource {
        DirSource {
            dir,
            interval: Duration::from_millis(100),
            fallback: Duration::from_secs(1),
            files: BTreeMap::new(),
            options,
        }
    }

    /// The objects of the files as they last parsed.
    pub fn objects(&self) -> impl Iterator<Item = &Value> {
        self.files.values().flat_map(|(_, objects)| objects.iter())
    }

    /// Read the directory: a snapshot, or None when nothing changed.
    pub fn poll(&mut self) -> Option<Snapshot> {
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
            let path = self.dir.join(&name);
            let previous = self.files.remove(&name);
            let bytes = match std::fs::read(&path) {
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
                    match parse(&bytes) {
                        Ok(objects) => objects,
                        Err(e) => {
                            problems.push(Problem::new(
                                &name,
                                "",
                                format!("not YAML or JSON: {e}"),
                            ));
                            previous.map(|(_, objects)| objects).unwrap_or_default()
                        }
                    }
                }
            };
            files.insert(name, (bytes, objects));
        }
        self.files = files;
        if !changed {
            return None;
        }
        let objects = self
            .files
            .values()
            .flat_map(|(_, objects)| objects.iter().cloned())
            .collect();
        let mut snapshot = knative::map(&self.options, objects);
        snapshot.problems.extend(problems);
        Some(snapshot)
    }
}

impl Source for DirSource {
    fn describe(&self) -> String {
        format!("dir:{}", self.dir.display())
    }

    fn run(mut self: Box<Self>, out: Snapshots) {
        let (tx, changes) = std::sync::mpsc::channel();
        let watcher = watch(&self.dir, tx);
        let wait = if watcher.is_some() {
            self.fallback
        } else {
            self.interval
        };
        let mut last: Option<Snapshot> = None;
        loop {
            if let Some(snapshot) = self.poll() {
                if last.as_ref() != Some(&snapshot) {
                    log::info!(
                        "{}: {} channel(s), {} with problems",
                        self.describe(),
                        snapshot.channels.len(),
                        snapshot
                            .channels
                            .values()
                            .filter(|c| !c.problems.is_empty())
                            .count()
                    );
                    if out.send(Some(Arc::new(snapshot.clone()))).is_err() {
                        return;
                    }
                    last = Some(snapshot);
                }
            } else if out.is_closed() {
                return;
            }
            // A change wakes the source at once; the changes that came with it are read by
            // the same look.
            if changes.recv_timeout(wait).is_ok() {
                while changes.try_recv().is_ok() {}
            }
        }
    }
}

/// An inotify watch on `dir` that sends on `tx` at every change in it; None (logged) where
/// it cannot be set: the source then looks every 100 ms.
fn watch(dir: &Path, tx: std::sync::mpsc::Sender<()>) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let on_event = move |_: notify::Result<notify::Event>| {
        let _ = tx.send(());
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
    fn a_file_that_stops_parsing_keeps_its_objects() {
        let dir =
            std::env::temp_dir().join(format!("fanout-control-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let channel = "apiVersion: messaging.knative.dev/v1\nkind: InMemoryChannel\nmetadata: {name: a, namespace: default}\n\
                       spec: {subscribers: [{subscriberUri: 'http://x.example/'}]}\n";
        std::fs::write(dir.join("a.yaml"), channel).unwrap();
        std::fs::write(dir.join(".hidden.yaml"), "{").unwrap();
        let mut source = DirSource::new(dir.clone(), crate::model::MapOptions::default());
        let first = source.poll().unwrap();
        assert_eq!(first.channels.len(), 1);
        assert!(first.problems.is_empty(), "{:?}", first.problems);
        assert_eq!(source.poll(), None);
        std::fs::write(dir.join("a.yaml"), "kind: [").unwrap();
        let broken = source.poll().unwrap();
        assert_eq!(broken.channels, first.channels);
        assert_eq!(broken.problems[0].object, "a.yaml");
        std::fs::remove_file(dir.join("a.yaml")).unwrap();
        assert!(source.poll().unwrap().channels.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
