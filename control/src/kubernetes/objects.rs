//! The objects of every watched kind, as each kind's watch last listed them: the pure half
//! of the Kubernetes source. A relist (after a watch error, a 410 Gone, an apiserver restart)
//! is buffered until it is whole and then replaces the kind's objects at once, so a half list
//! is never seen; a kind whose CRD is not installed counts as listed, with no objects.

use serde_json::Value;
use std::collections::BTreeMap;

/// What one kind's watch says.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// A (re)list starts: the objects that follow, up to [`Update::ListDone`], are all of them.
    Restarted,
    /// An object of the list being read.
    Listed(Value),
    /// The list is whole.
    ListDone,
    /// An object was added or changed.
    Applied(Value),
    /// An object was deleted.
    Deleted(Value),
    /// The kind is not served by the API (its CRD is not installed).
    Absent,
}

#[derive(Default)]
struct KindState {
    /// The last whole list with the changes since; None until one arrived (or the kind is
    /// known to be absent).
    current: Option<BTreeMap<String, Value>>,
    /// A list being read.
    pending: Option<BTreeMap<String, Value>>,
}

/// Every kind's objects.
pub struct Objects {
    kinds: Vec<KindState>,
}

/// `namespace/name`: an object's key within its kind.
fn key(object: &Value) -> String {
    let field = |name: &str| {
        object
            .get("metadata")
            .and_then(|m| m.get(name))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    format!("{}/{}", field("namespace"), field("name"))
}

impl Objects {
    /// `kinds` kinds, none listed yet.
    pub fn new(kinds: usize) -> Objects {
        Objects {
            kinds: (0..kinds).map(|_| KindState::default()).collect(),
        }
    }

    /// Apply one update of kind `kind`; true when the objects served changed.
    pub fn apply(&mut self, kind: usize, update: Update) -> bool {
        let Some(state) = self.kinds.get_mut(kind) else {
            return false;
        };
        match update {
            Update::Restarted => {
                state.pending = Some(BTreeMap::new());
                false
            }
            Update::Listed(object) => {
                let pending = state.pending.get_or_insert_with(BTreeMap::new);
                pending.insert(key(&object), object);
                false
            }
            Update::ListDone => {
                let listed = state.pending.take().unwrap_or_default();
                let changed = state.current.as_ref() != Some(&listed);
                state.current = Some(listed);
                changed
            }
            Update::Applied(object) => {
                let current = state.current.get_or_insert_with(BTreeMap::new);
                current.insert(key(&object), object.clone()) != Some(object)
            }
            Update::Deleted(object) => state
                .current
                .as_mut()
                .is_some_and(|current| current.remove(&key(&object)).is_some()),
            Update::Absent => {
                state.pending = None;
                let changed = state.current.as_ref().is_none_or(|c| !c.is_empty());
                state.current = Some(BTreeMap::new());
                changed
            }
        }
    }

    /// Whether every kind has been listed whole (or is absent).
    pub fn complete(&self) -> bool {
        self.kinds.iter().all(|k| k.current.is_some())
    }

    /// Every object of every kind, as last listed whole with the changes since.
    pub fn all(&self) -> Vec<Value> {
        self.kinds
            .iter()
            .filter_map(|k| k.current.as_ref())
            .flat_map(|objects| objects.values().cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(name: &str, generation: u64) -> Value {
        json!({ "metadata": { "namespace": "shop", "name": name, "generation": generation } })
    }

    #[test]
    fn nothing_is_complete_until_every_kind_listed_whole_or_absent() {
        let mut objects = Objects::new(2);
        assert!(!objects.complete());
        objects.apply(0, Update::Restarted);
        objects.apply(0, Update::Listed(object("a", 1)));
        assert!(!objects.complete());
        assert!(objects.apply(0, Update::ListDone));
        assert!(!objects.complete());
        objects.apply(1, Update::Absent);
        assert!(objects.complete());
        assert_eq!(objects.all(), vec![object("a", 1)]);
    }

    #[test]
    fn a_relist_replaces_the_kind_only_once_whole() {
        let mut objects = Objects::new(1);
        objects.apply(0, Update::Restarted);
        objects.apply(0, Update::Listed(object("a", 1)));
        objects.apply(0, Update::Listed(object("b", 1)));
        objects.apply(0, Update::ListDone);
        // The watch broke; the relist has read one object so far.
        assert!(!objects.apply(0, Update::Restarted));
        assert!(!objects.apply(0, Update::Listed(object("b", 2))));
        assert_eq!(objects.all(), vec![object("a", 1), object("b", 1)]);
        assert!(objects.apply(0, Update::ListDone));
        assert_eq!(objects.all(), vec![object("b", 2)]);
        // The same list again changes nothing.
        objects.apply(0, Update::Restarted);
        objects.apply(0, Update::Listed(object("b", 2)));
        assert!(!objects.apply(0, Update::ListDone));
    }

    #[test]
    fn changes_after_the_list_apply_one_by_one() {
        let mut objects = Objects::new(1);
        objects.apply(0, Update::Restarted);
        objects.apply(0, Update::ListDone);
        assert!(objects.apply(0, Update::Applied(object("a", 1))));
        assert!(!objects.apply(0, Update::Applied(object("a", 1))));
        assert!(objects.apply(0, Update::Applied(object("a", 2))));
        assert!(objects.apply(0, Update::Deleted(object("a", 2))));
        assert!(!objects.apply(0, Update::Deleted(object("a", 2))));
        assert!(objects.all().is_empty());
        // The CRD went: its objects went with it.
        objects.apply(0, Update::Applied(object("b", 1)));
        assert!(objects.apply(0, Update::Absent));
        assert!(objects.all().is_empty() && objects.complete());
    }
}
