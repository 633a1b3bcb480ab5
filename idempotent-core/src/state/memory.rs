//! [`MemoryStateStore`]: states in the process, for one process and for tests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::{Commit, CommitToken, Loaded, Scope, StateStore, Version, history};
use crate::error::Error;
use crate::store::BoxFuture;

/// A [`StateStore`] in memory: one map of scopes behind a mutex, shared by clones. States are
/// kept until the store is dropped.
#[derive(Debug, Clone, Default)]
pub struct MemoryStateStore {
    states: Arc<Mutex<HashMap<[u8; 32], Entry>>>,
}

#[derive(Debug)]
struct Entry {
    version: Version,
    value: Bytes,
    /// The last [`COMMIT_HISTORY`](super::COMMIT_HISTORY) commit tokens, newest last.
    tokens: Vec<u8>,
}

impl MemoryStateStore {
    /// An empty store.
    pub fn new() -> MemoryStateStore {
        MemoryStateStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Entry>> {
        crate::store::lock(&self.states)
    }
}

impl StateStore for MemoryStateStore {
    fn load<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
        let loaded = match self.lock().get(scope.digest()) {
            Some(e) => Loaded { value: Some(e.value.clone()), version: e.version },
            None => Loaded { value: None, version: Version::ABSENT },
        };
        Box::pin(std::future::ready(Ok(loaded)))
    }

    fn commit<'a>(
        &'a self,
        scope: &'a Scope,
        expected: Version,
        value: Bytes,
        token: &'a CommitToken,
    ) -> BoxFuture<'a, Result<Commit<Bytes>, Error>> {
        let mut states = self.lock();
        let answer = match states.get_mut(scope.digest()) {
            Some(e) => {
                if let Some(version) = history::find(&e.tokens, e.version, token) {
                    Commit::Committed { version, replayed: true }
                } else if e.version != expected {
                    Commit::Conflict { current: Loaded { value: Some(e.value.clone()), version: e.version } }
                } else {
                    e.version = e.version.next();
                    e.value = value;
                    e.tokens = history::push(&e.tokens, token);
                    Commit::Committed { version: e.version, replayed: false }
                }
            }
            None if expected.is_absent() => {
                let version = expected.next();
                states.insert(*scope.digest(), Entry { version, value, tokens: token.as_bytes().to_vec() });
                Commit::Committed { version, replayed: false }
            }
            None => Commit::Conflict { current: Loaded { value: None, version: Version::ABSENT } },
        };
        drop(states);
        Box::pin(std::future::ready(Ok(answer)))
    }

    fn describe(&self) -> String {
        "memory".to_owned()
    }
}
