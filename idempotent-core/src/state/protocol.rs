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
