//! The process-wide key-value store with compare-and-swap that proxy-wasm's shared data
//! gives the wasm build (the `envoy` dedupe store lives in it). Envoy's dynamic-module ABI
//! shares pointers between modules, not values; but Envoy loads the library once per
//! process, so a `static` in it is seen by every worker, and this one keeps Envoy's rules:
//! a `get` gives the value and its CAS, a `set` with a CAS that no longer matches fails, a
//! key that does not exist is written whatever the CAS says, and every write moves the CAS.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use fanout::host::CasMismatch;

/// Values and their CAS by key.
#[derive(Default)]
pub struct CasStore {
    entries: Mutex<HashMap<String, (Vec<u8>, u32)>>,
}

impl CasStore {
    /// An empty store.
    pub fn new() -> Self {
        CasStore::default()
    }

    /// The value of `key` and its CAS; `(None, None)` when it does not exist.
    pub fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        match entries.get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    /// Writes `value` if the CAS of `key` is still `cas` (`None`: unconditionally; a key
    /// that does not exist is written whatever `cas` says).
    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        match entries.get_mut(key) {
            Some((_, current)) if cas.is_some_and(|cas| cas != *current) => Err(CasMismatch),
            Some((old, current)) => {
                value.clone_into(old);
                *current = current.wrapping_add(1).max(1);
                Ok(())
            }
            None => {
                entries.insert(key.to_string(), (value.to_vec(), 1));
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_key_has_no_value_and_no_cas() {
        assert_eq!(CasStore::new().get("k"), (None, None));
    }

    #[test]
    fn a_missing_key_is_written_whatever_the_cas() {
        let store = CasStore::new();
        assert_eq!(store.set("k", b"v", Some(42)), Ok(()));
        assert_eq!(store.get("k"), (Some(b"v".to_vec()), Some(1)));
    }

    #[test]
    fn a_write_with_the_current_cas_succeeds_and_moves_it() {
        let store = CasStore::new();
        store.set("k", b"1", None).unwrap();
        let (_, cas) = store.get("k");
        assert_eq!(store.set("k", b"2", cas), Ok(()));
        let (value, next) = store.get("k");
        assert_eq!(value.as_deref(), Some(&b"2"[..]));
        assert_ne!(next, cas);
    }

    #[test]
    fn a_write_with_a_stale_cas_fails_and_changes_nothing() {
        let store = CasStore::new();
        store.set("k", b"1", None).unwrap();
        let (_, stale) = store.get("k");
        store.set("k", b"2", stale).unwrap();
        assert_eq!(store.set("k", b"3", stale), Err(CasMismatch));
        assert_eq!(store.get("k").0.as_deref(), Some(&b"2"[..]));
    }

    #[test]
    fn an_unconditional_write_always_succeeds() {
        let store = CasStore::new();
        store.set("k", b"1", None).unwrap();
        assert_eq!(store.set("k", b"2", None), Ok(()));
        assert_eq!(store.get("k").0.as_deref(), Some(&b"2"[..]));
    }

    #[test]
    fn two_threads_racing_on_one_cas_one_wins() {
        let store = std::sync::Arc::new(CasStore::new());
        store.set("k", b"0", None).unwrap();
        let (_, cas) = store.get("k");
        let wins: usize = (0..8)
            .map(|i| {
                let store = store.clone();
                std::thread::spawn(move || store.set("k", &[i], cas).is_ok())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| usize::from(t.join().unwrap()))
            .sum();
        assert_eq!(wins, 1);
    }
}
