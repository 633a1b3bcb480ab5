//! The raw state protocol a store implements: bytes, [`Version`]s and commit tokens.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use crate::error::Error;
use crate::store::BoxFuture;

use super::{COMMIT_HISTORY, CommitToken, Scope};

/// A state's version: 0 while the state is absent, then one more for every commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Version(u64);

impl Version {
    /// The version of an absent state.
    pub const ABSENT: Version = Version(0);

    /// A version from its number (0: absent).
    pub const fn new(n: u64) -> Version {
        Version(n)
    }

    /// Its number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Whether this is the version of an absent state.
    pub const fn is_absent(self) -> bool {
        self.0 == 0
    }

    /// The version a commit on this one produces.
    pub(crate) const fn next(self) -> Version {
        Version(self.0 + 1)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A state as loaded: its value (`None` while absent) and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded<T> {
    /// The value, `None` while the state is absent.
    pub value: Option<T>,
    /// The version ([`Version::ABSENT`] while absent).
    pub version: Version,
}

/// A store's answer to a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Commit<T> {
    /// The value was committed and is `version` (or, `replayed`, a commit with the same token
    /// was already applied and produced `version`: nothing changed).
    Committed {
        /// The version the commit produced.
        version: Version,
        /// Whether this token's commit had already been applied (a retry after a lost reply).
        replayed: bool,
    },
    /// The expected version is not current: nothing changed.
    Conflict {
        /// The state as it is.
        current: Loaded<T>,
    },
}

impl<T> Commit<T> {
    /// Whether the commit was refused.
    pub fn is_conflict(&self) -> bool {
        matches!(self, Commit::Conflict { .. })
    }
}

/// The raw state protocol a store implements: bytes, versions and commit tokens.
///
/// Each method is atomic per scope. `commit` must first look `token` up among the scope's last
/// [`COMMIT_HISTORY`] commit tokens (answering [`Commit::Committed`] with `replayed: true` and the
/// version it produced when found), then compare `expected` with the current version, and on a
/// match store `value` as version `expected + 1` together with `token`.
pub trait StateStore: Send + Sync + 'static {
    /// The state of `scope`.
    fn load<'a>(&'a self, scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>>;

    /// Stores `value` if the state is at `expected` and `token` was not applied yet.
    fn commit<'a>(
        &'a self,
        scope: &'a Scope,
        expected: Version,
        value: Bytes,
        token: &'a CommitToken,
    ) -> BoxFuture<'a, Result<Commit<Bytes>, Error>>;

    /// A short description for logs and errors (a URL without credentials, or `memory`).
    fn describe(&self) -> String;

    /// How many commit tokens the store keeps per scope: [`COMMIT_HISTORY`] unless the store
    /// says otherwise (`RedisStore` keeps [`REDIS_COMMIT_HISTORY`](super::REDIS_COMMIT_HISTORY), as its history costs a
    /// commit nothing more).
    fn commit_history(&self) -> u64 {
        COMMIT_HISTORY
    }
}

/// A shared, type-erased state store.
pub type SharedStateStore = Arc<dyn StateStore>;

/// Turns a concrete state store (or an existing handle) into a [`SharedStateStore`].
pub trait IntoSharedStateStore {
    /// Performs the conversion.
    fn into_shared_state(self) -> SharedStateStore;
}

impl<S: StateStore> IntoSharedStateStore for S {
    fn into_shared_state(self) -> SharedStateStore {
        Arc::new(self)
    }
}

impl IntoSharedStateStore for SharedStateStore {
    fn into_shared_state(self) -> SharedStateStore {
        self
    }
}

/// The state store behind a record store's handle, so one handle serves both
/// [`RunContext`](crate::RunContext) and [`State`](super::State): the crate's stores
/// ([`MemoryStore`](crate::MemoryStore), `RedisStore`, `SqliteStore`, `PostgresStore`) keep
/// versioned states as well as records. A store of another type behind the handle keeps none:
/// every load and commit through it then fails with [`Error::Config`] saying so (hand such a
/// store's own [`StateStore`] to `State::new` instead).
impl IntoSharedStateStore for crate::store::SharedStore {
    fn into_shared_state(self) -> SharedStateStore {
        let any: Arc<dyn std::any::Any + Send + Sync> = self.clone();
        let any = match any.downcast::<crate::MemoryStore>() {
            Ok(store) => return store,
            Err(any) => any,
        };
        #[cfg(feature = "redis")]
        let any = match any.downcast::<crate::RedisStore>() {
            Ok(store) => return store,
            Err(any) => any,
        };
        #[cfg(feature = "sqlite")]
        let any = match any.downcast::<crate::SqliteStore>() {
            Ok(store) => return store,
            Err(any) => any,
        };
        #[cfg(feature = "postgres")]
        let any = match any.downcast::<crate::PostgresStore>() {
            Ok(store) => return store,
            Err(any) => any,
        };
        drop(any);
        Arc::new(NoStates { describe: self.describe() })
    }
}

/// What a record store that keeps no states answers as a state store.
struct NoStates {
    describe: String,
}

impl NoStates {
    fn refused(&self) -> Error {
        Error::Config(format!(
            "the store {} keeps no versioned states: give State::new a StateStore (such as MemoryStateStore, or \
             one of the crate's stores) rather than this store's SharedStore",
            self.describe
        ))
    }
}

impl StateStore for NoStates {
    fn load<'a>(&'a self, _scope: &'a Scope) -> BoxFuture<'a, Result<Loaded<Bytes>, Error>> {
        Box::pin(std::future::ready(Err(self.refused())))
    }

    fn commit<'a>(
        &'a self,
        _scope: &'a Scope,
        _expected: Version,
        _value: Bytes,
        _token: &'a CommitToken,
    ) -> BoxFuture<'a, Result<Commit<Bytes>, Error>> {
        Box::pin(std::future::ready(Err(self.refused())))
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

/// The tokens a store keeps per scope, newest last, each 16 bytes: the one at index `i` of `n`
/// produced version `current - (n - 1 - i)`. Shared by the stores that keep them in one value
/// (memory, SQL).
pub(crate) mod history {
    use super::{COMMIT_HISTORY, CommitToken, Version};

    /// The version `token` produced, if it is among `tokens` (whose newest produced `current`).
    pub(crate) fn find(tokens: &[u8], current: Version, token: &CommitToken) -> Option<Version> {
        let n = tokens.len() / 16;
        tokens
            .chunks_exact(16)
            .rposition(|t| t == token.as_bytes())
            .map(|i| Version::new(current.get() - (n - 1 - i) as u64))
    }

    /// `tokens` with `token` appended, keeping the newest [`COMMIT_HISTORY`].
    pub(crate) fn push(tokens: &[u8], token: &CommitToken) -> Vec<u8> {
        let keep = (COMMIT_HISTORY as usize - 1) * 16;
        let tokens = &tokens[tokens.len() - (tokens.len() / 16 * 16).min(keep)..];
        let mut out = Vec::with_capacity(tokens.len() + 16);
        out.extend_from_slice(tokens);
        out.extend_from_slice(token.as_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_finds_each_kept_token_with_its_version_and_forgets_the_oldest() {
        let mut tokens = Vec::new();
        let token = |i: u64| CommitToken::derive(&i.to_string());
        for v in 1..=200u64 {
            tokens = history::push(&tokens, &token(v));
        }
        assert_eq!(tokens.len(), COMMIT_HISTORY as usize * 16);
        let current = Version::new(200);
        for v in 200 - COMMIT_HISTORY + 1..=200 {
            assert_eq!(history::find(&tokens, current, &token(v)), Some(Version::new(v)));
        }
        assert_eq!(history::find(&tokens, current, &token(200 - COMMIT_HISTORY)), None);
        assert_eq!(history::find(&[], Version::ABSENT, &token(1)), None);
    }
}
