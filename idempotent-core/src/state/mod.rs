//! Versioned shared state: optimistic concurrency for parallel workers, without lost or doubled
//! updates.
//!
//! Parallel sub-agents and workers that update one shared value (a cart, the findings of a run)
//! each read it with its version, compute a new value, and commit it only if the version is
//! still the one they read. A stale commit is refused with the current version and value
//! ([`Commit::Conflict`]); [`State::update`] then loads again and re-applies its reducer, with
//! full-jitter backoff between conflicts ([`Backoff`]), bounded by attempts and time
//! ([`UpdatePolicy`]), and ends in [`Error::Contention`] saying how many attempts it made.
//!
//! ```
//! use idempotent_core::state::{MemoryStateStore, Scope, State};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idempotent_core::Error> {
//! let store = MemoryStateStore::new();
//! let cart: State<Vec<String>> = State::new(store, Scope::new("cart-42").tenant("acme"));
//!
//! let loaded = cart.load().await?;
//! assert!(loaded.value.is_none() && loaded.version.is_absent());
//!
//! // Load, apply, commit; again on a conflict.
//! let updated = cart.modify(|items| items.push("tea".into())).await?;
//! assert_eq!(updated.value, ["tea"]);
//!
//! // A commit on a version that is no longer current is refused.
//! let stale = loaded.version;
//! assert!(cart.commit(stale, &vec!["coffee".into()]).await?.is_conflict());
//! assert_eq!(cart.load().await?.value.unwrap(), ["tea"]);
//! # Ok(()) }
//! ```
//!
//! # Retries without doubled updates
//!
//! A naive loop applies a delta twice when the reply to a successful commit is lost: the retry
//! finds the version moved (by its own write), reloads and applies again. Here every commit
//! carries a [`CommitToken`], and the store keeps the tokens of the last [`COMMIT_HISTORY`]
//! commits of each scope ([`REDIS_COMMIT_HISTORY`] on Redis) with the version each produced. A commit whose token is among them was
//! already applied: it answers [`Commit::Committed`] with that version and `replayed: true`,
//! changes nothing, and never reports a conflict with itself.
//!
//! By default the token is derived from the calling step's operation key (the [`Attempt`] of
//! [`current_attempt`](crate::current_attempt)) and the scope, and numbered by the order of the
//! action's state updates: the n-th update of an action gets the same token on every attempt at
//! the step, so a step retried after a lost reply (or a crash after the commit) replays its
//! update instead of applying it again. A handler behind `idempotent-tower`'s `IdempotencyLayer`
//! runs with its request's attempt in scope, so its updates are tied to the request's key the
//! same way: a request retried after its response was lost replays them.
//!
//! Outside both, each [`State::update`] draws a random token, which covers the retries inside
//! that one call only. When such an update gives up after a commit whose answer was lost, the
//! commit may have landed, and it says so: [`Error::CommitUnanswered`]
//! ([`action_may_have_run`](Error::action_may_have_run) is true, and it is not
//! [transient](Error::is_transient), since calling `update` again would draw a new token). It
//! carries the token ([`Error::commit_token`]): retry under it with [`State::update_with_token`],
//! which applies the update at most once. A caller that retries logical updates of its own
//! gives each one a token from the start, derived from the update's id with
//! [`CommitToken::derive`] ([`State::update_with_token`], [`State::commit_with_token`]).
//!
//! ```
//! use idempotent_core::state::{CommitToken, MemoryStateStore, Scope, State};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idempotent_core::Error> {
//! let counter: State<u64> = State::new(MemoryStateStore::new(), Scope::new("visits"));
//! let token = CommitToken::derive("visit-7f3a"); // the logical update's own id
//! for _retry in 0..3 {
//!     // However often this runs (retried after a lost reply, after a crash), it counts once.
//!     counter.update_with_token(&token, |n| Ok::<_, std::convert::Infallible>(n.unwrap_or(0) + 1)).await?;
//! }
//! assert_eq!(counter.load().await?.value, Some(1));
//! # Ok(()) }
//! ```
//!
//! **The bound.** A retry is recognised as long as fewer than [`StateStore::commit_history`] other
//! commits (128; 1024 on Redis) landed on the scope between the lost reply and the retry. [`State::update`] sends a
//! commit that failed on the way again as it was, after the shortest backoff delay, and checks
//! the bound itself: if the answer is a conflict with a state that moved on by the whole history
//! or more since, it stops with [`Error::StateUncertain`] instead of risking a second
//! application.
//!
//! # Stores
//!
//! [`StateStore`] is the raw protocol (bytes, versions, tokens). [`MemoryStateStore`] keeps
//! states in the process; the record stores implement it too, each on its own connections:
//! `RedisStore` (one hash per scope, one Lua script per commit, so cluster safe), `SqliteStore`
//! and `PostgresStore` (a table of their own next to the records', `UPDATE … WHERE version =
//! $n` and insert-if-absent). Values are the canonical JSON ([`crate::canonical`]) of the
//! handle's type; [`RawState`] is the same handle over bytes.
//!
//! # With steps
//!
//! A step whose action is a state update commits under the step's token, so a retried step never
//! applies its update twice; a step's result merged into a thread's state is that same pattern,
//! with the merge as the reducer:
//!
//! ```
//! use idempotent_core::state::{MemoryStateStore, Scope, State};
//! use idempotent_core::{Error, MemoryStore, RunContext};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Error> {
//! let findings: State<Vec<String>> = State::new(MemoryStateStore::new(), Scope::new("thread-9"));
//! let ctx = RunContext::new(MemoryStore::new(), "thread-9");
//! for _retry in 0..2 {
//!     ctx.step("search").run(&"rust occ", |_| async {
//!         let found = "crate: idempotent".to_string(); // the step's work
//!         findings.modify(|all| all.push(found.clone())).await?; // merged into the thread's state
//!         Ok::<_, Error>(())
//!     }).await?;
//! }
//! assert_eq!(findings.load().await?.value.unwrap(), ["crate: idempotent"]);
//! # Ok(()) }
//! ```
//!
//! The action may run again (a retry after its step's result was lost, a recovered attempt), and
//! its update then replays; keep reducers pure, as they may run more than once per update.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::backoff::Backoff;
use crate::error::{BoxError, Error};
use crate::store::BoxFuture;

mod memory;
#[cfg(feature = "redis")]
mod redis;

pub use memory::MemoryStateStore;

#[cfg(doc)]
use crate::attempt::Attempt;

/// How many commit tokens a store keeps per scope, with the version each produced: a commit
/// retried after a lost reply is recognised while fewer than this many other commits have
/// landed since (see the [module documentation](self)).
pub const COMMIT_HISTORY: u64 = 128;

/// How many commit tokens `RedisStore` keeps per scope: a hash field per token and one per slot,
/// dropped in O(1) per commit, so a longer history costs memory only (about 90 bytes a token).
pub const REDIS_COMMIT_HISTORY: u64 = 1024;

/// Which state: a name (a thread id, a cart id) within an optional tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    tenant: Option<String>,
    name: String,
    digest: [u8; 32],
}

impl Scope {
    /// The state named `name`, outside any tenant.
    pub fn new(name: impl Into<String>) -> Scope {
        let name = name.into();
        let digest = Self::digest_of(None, &name);
        Scope { tenant: None, name, digest }
    }

    /// The same name within `tenant` (a different state from the name in another tenant).
    pub fn tenant(mut self, tenant: impl Into<String>) -> Scope {
        let tenant = tenant.into();
        self.digest = Self::digest_of(Some(&tenant), &self.name);
        self.tenant = Some(tenant);
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tenant, if any.
    pub fn tenant_name(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// The sha256 the stores key the state by (so that names can hold any character and a
    /// tenant cannot reach another's state).
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    fn digest_of(tenant: Option<&str>, name: &str) -> [u8; 32] {
        let mut h = Sha256::new();
        field(&mut h, b"idempotent/state-scope");
        match tenant {
            None => h.update([0u8]),
            Some(t) => {
                h.update([1u8]);
                field(&mut h, t.as_bytes());
            }
        }
        field(&mut h, name.as_bytes());
        h.finalize().into()
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tenant {
            Some(t) => write!(f, "{t}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

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

/// What names one logical update, so that the store applies it once however often its commit is
/// retried: 16 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommitToken([u8; 16]);

impl CommitToken {
    /// A token from its bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> CommitToken {
        CommitToken(bytes)
    }

    /// A token derived from an id of the caller's (a request id, a message id): the same id
    /// gives the same token.
    pub fn derive(id: &str) -> CommitToken {
        let mut h = Sha256::new();
        field(&mut h, b"idempotent/state-commit/explicit");
        field(&mut h, id.as_bytes());
        Self::truncated(h)
    }

    /// A fresh random token.
    pub fn random() -> CommitToken {
        CommitToken(*uuid::Uuid::new_v4().as_bytes())
    }

    /// The token of the next update of `scope` in the current step's action (see the
    /// [module documentation](self)), or a random one outside a step.
    pub fn for_update(scope: &Scope) -> CommitToken {
        Self::for_update_derived(scope).0
    }

    /// [`for_update`](Self::for_update), and whether the token is derived (a retry of the
    /// step gets it again) rather than random.
    pub(crate) fn for_update_derived(scope: &Scope) -> (CommitToken, bool) {
        match crate::attempt::current_attempt() {
            Some(attempt) => (Self::of_attempt(&attempt, scope), true),
            None => (Self::random(), false),
        }
    }

    /// The token of the next update of `scope` by `attempt`'s action.
    pub fn of_attempt(attempt: &crate::Attempt, scope: &Scope) -> CommitToken {
        let n = attempt.next_state_commit();
        let mut h = Sha256::new();
        field(&mut h, b"idempotent/state-commit/step");
        h.update(attempt.key().as_bytes());
        h.update(scope.digest());
        h.update(n.to_be_bytes());
        Self::truncated(h)
    }

    fn truncated(h: Sha256) -> CommitToken {
        let digest: [u8; 32] = h.finalize().into();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        CommitToken(out)
    }

    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Its 32 hex digits.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(32);
        crate::key::push_hex(&mut s, &self.0);
        s
    }
}

impl fmt::Debug for CommitToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CommitToken({})", self.to_hex())
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
    /// says otherwise (`RedisStore` keeps [`REDIS_COMMIT_HISTORY`], as its history costs a
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

/// The bounds of [`State::update`]: the backoff between conflicts (its
/// [`attempts`](Backoff::attempts) are the load, reduce and commit rounds in all) and the time
/// the update may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdatePolicy {
    backoff: Backoff,
    max_elapsed: Duration,
}

impl UpdatePolicy {
    /// At most `backoff.attempts()` rounds, waiting `backoff`'s full-jitter delays between
    /// them, within `max_elapsed`.
    pub const fn new(backoff: Backoff, max_elapsed: Duration) -> UpdatePolicy {
        UpdatePolicy { backoff, max_elapsed }
    }

    /// The same policy with `attempts` rounds at most.
    pub const fn attempts(mut self, attempts: u32) -> UpdatePolicy {
        self.backoff = self.backoff.max_attempts(attempts);
        self
    }

    /// The same policy, bounded by `max_elapsed`.
    pub const fn max_elapsed(mut self, max_elapsed: Duration) -> UpdatePolicy {
        self.max_elapsed = max_elapsed;
        self
    }

    /// The backoff.
    pub const fn backoff(&self) -> Backoff {
        self.backoff
    }
}

impl Default for UpdatePolicy {
    /// 1 ms base, doubling to 100 ms at most, 1 000 rounds, 10 s: the time bounds it first. (64
    /// rounds starved a task of 64 contending for one PostgreSQL row in `state_bench`: each
    /// commit there waits for an fsync.)
    fn default() -> Self {
        UpdatePolicy {
            backoff: Backoff::new(Duration::from_millis(1), Duration::from_millis(100)).max_attempts(1000),
            max_elapsed: Duration::from_secs(10),
        }
    }
}

/// The outcome of an update.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Updated<T> {
    /// The value committed; when `replayed`, the state as loaded (again, if need be) after the
    /// commit that counted, which holds this update, applied once.
    pub value: T,
    /// The version the update's commit produced.
    pub version: Version,
    /// How many load, reduce and commit rounds it took.
    pub attempts: u32,
    /// Whether the commit that counted was an earlier one with the same token, whose reply was
    /// lost.
    pub replayed: bool,
}

/// A handle on one scope's state, over bytes: [`State`] without the encoding.
#[derive(Clone)]
pub struct RawState {
    store: SharedStateStore,
    scope: Scope,
    policy: UpdatePolicy,
}

impl fmt::Debug for RawState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawState")
            .field("store", &self.store.describe())
            .field("scope", &self.scope.to_string())
            .field("policy", &self.policy)
            .finish()
    }
}

impl RawState {
    /// A handle on `scope`'s state in `store`, with the default [`UpdatePolicy`].
    pub fn new(store: impl IntoSharedStateStore, scope: Scope) -> RawState {
        RawState { store: store.into_shared_state(), scope, policy: UpdatePolicy::default() }
    }

    /// The same handle with `policy` for its updates.
    pub fn with_policy(mut self, policy: UpdatePolicy) -> RawState {
        self.policy = policy;
        self
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The store.
    pub fn store(&self) -> &SharedStateStore {
        &self.store
    }

    /// The value and version.
    pub async fn load(&self) -> Result<Loaded<Bytes>, Error> {
        self.store.load(&self.scope).await
    }

    /// Commits `value` on `expected`, under the token [`CommitToken::for_update`] gives.
    pub async fn commit(&self, expected: Version, value: Bytes) -> Result<Commit<Bytes>, Error> {
        self.commit_with_token(expected, value, &CommitToken::for_update(&self.scope)).await
    }

    /// Commits `value` on `expected`, under `token`.
    pub async fn commit_with_token(
        &self,
        expected: Version,
        value: Bytes,
        token: &CommitToken,
    ) -> Result<Commit<Bytes>, Error> {
        self.store.commit(&self.scope, expected, value, token).await
    }

    /// Load, apply `reducer`, commit; again on a conflict (see [`State::update`]).
    pub async fn update<E, F>(&self, reducer: F) -> Result<Updated<Bytes>, Error>
    where
        F: FnMut(Option<&[u8]>) -> Result<Bytes, E>,
        E: Into<BoxError>,
    {
        let (token, derived) = CommitToken::for_update_derived(&self.scope);
        self.update_under(&token, derived, reducer).await
    }

    /// [`update`](Self::update) under `token`.
    pub async fn update_with_token<E, F>(&self, token: &CommitToken, reducer: F) -> Result<Updated<Bytes>, Error>
    where
        F: FnMut(Option<&[u8]>) -> Result<Bytes, E>,
        E: Into<BoxError>,
    {
        self.update_under(token, true, reducer).await
    }

    /// The update loop, under `token`; `derived` says whether a retry of the caller's call gets
    /// the same token (for the error an update that may have landed ends in).
    async fn update_under<E, F>(
        &self,
        token: &CommitToken,
        derived: bool,
        mut reducer: F,
    ) -> Result<Updated<Bytes>, Error>
    where
        F: FnMut(Option<&[u8]>) -> Result<Bytes, E>,
        E: Into<BoxError>,
    {
        let started = tokio::time::Instant::now();
        let policy = &self.policy;
        let attempts = policy.backoff.attempts();
        let scope = &self.scope;
        let history = self.store.commit_history();
        // The version a commit that failed on the way expected: that commit may have landed.
        let mut uncertain: Option<Version> = None;
        // The state a conflict answered with, to reduce without loading again.
        let mut known: Option<Loaded<Bytes>> = None;
        // A commit that failed on the way, to send again as it was: its answer tells whether it
        // (or its first sending) went in.
        let mut resend: Option<(Loaded<Bytes>, Bytes)> = None;
        // The version this update's commit produced, once the store said so and the value is
        // still to be read.
        let mut applied: Option<Version> = None;
        let mut last_error: Option<Error> = None;
        // Every way out with an error: when a commit of this update may have landed (or did),
        // the caller must hear so, and under which token to retry.
        let give_up = |error: Error, uncertain: Option<Version>, applied: Option<Version>| {
            if uncertain.is_none() && applied.is_none() {
                return error;
            }
            Error::CommitUnanswered {
                scope: scope.to_string(),
                token: *token,
                retry_derives_token: derived,
                source: Box::new(error),
            }
        };
        for round in 1..=attempts {
            let mut quick = false;
            'round: {
                if let Some(version) = applied {
                    match self.store.load(scope).await {
                        Ok(Loaded { value: Some(value), .. }) => {
                            return Ok(Updated { value, version, attempts: round, replayed: true });
                        }
                        Ok(Loaded { value: None, .. }) => {
                            return Err(Error::Corrupt {
                                key: crate::Key::from_bytes(*scope.digest()).short(),
                                detail: format!("state {scope}: absent after a commit of version {version}"),
                            });
                        }
                        Err(e) if e.is_transient() => {
                            last_error = Some(e);
                            quick = true;
                            break 'round;
                        }
                        Err(e) => return Err(give_up(e, uncertain, applied)),
                    }
                }
                let (loaded, new) = match resend.take() {
                    Some(pending) => pending,
                    None => {
                        let loaded = match known.take() {
                            Some(loaded) => loaded,
                            None => match self.store.load(scope).await {
                                Ok(loaded) => loaded,
                                Err(e) if e.is_transient() => {
                                    last_error = Some(e);
                                    break 'round;
                                }
                                Err(e) => return Err(give_up(e, uncertain, applied)),
                            },
                        };
                        let new = reducer(loaded.value.as_deref())
                            .map_err(|e| Error::Reducer { scope: scope.to_string(), source: e.into() })?;
                        (loaded, new)
                    }
                };
                match self.store.commit(scope, loaded.version, new.clone(), token).await {
                    Ok(Commit::Committed { version, replayed: false }) => {
                        return Ok(Updated { value: new, version, attempts: round, replayed: false });
                    }
                    Ok(Commit::Committed { version, replayed: true }) => {
                        // The state as loaded holds this update when it is at the version the
                        // update produced or later; after a resend of a commit from before that
                        // (the first one's reply was lost), the next rounds read it again.
                        match loaded.value {
                            Some(value) if loaded.version >= version => {
                                return Ok(Updated { value, version, attempts: round, replayed: true });
                            }
                            _ => {
                                applied = Some(version);
                                quick = true;
                            }
                        }
                    }
                    Ok(Commit::Conflict { current }) => {
                        // The store looked the token up first: within the history, not found
                        // means the uncertain commit did not go in.
                        if let Some(from) = uncertain.take()
                            && current.version.get().saturating_sub(from.get()) >= history
                        {
                            return Err(Error::StateUncertain {
                                scope: scope.to_string(),
                                from: from.get(),
                                current: current.version.get(),
                                history,
                            });
                        }
                        last_error = None;
                        known = Some(current);
                    }
                    Err(e) if e.is_transient() => {
                        uncertain.get_or_insert(loaded.version);
                        last_error = Some(e);
                        resend = Some((loaded, new));
                        // Sent again soon, while the history surely still holds its token.
                        quick = true;
                    }
                    Err(e) => return Err(give_up(e, uncertain, applied)),
                }
            }
            if round == attempts || !self.pause(if quick { 1 } else { round }, started).await {
                let error = last_error.unwrap_or_else(|| self.contention(round, started));
                return Err(give_up(error, uncertain, applied));
            }
        }
        Err(give_up(last_error.unwrap_or_else(|| self.contention(attempts, started)), uncertain, applied))
    }

    fn contention(&self, attempts: u32, started: tokio::time::Instant) -> Error {
        Error::Contention { scope: self.scope.to_string(), attempts, elapsed: started.elapsed() }
    }

    /// Waits the backoff after round `round` (1-based), unless that would pass the time bound:
    /// then answers `false` without waiting.
    async fn pause(&self, round: u32, started: tokio::time::Instant) -> bool {
        let random = uuid::Uuid::new_v4().as_u64_pair().0;
        let delay = self.policy.backoff.delay(round - 1, random);
        if started.elapsed() + delay > self.policy.max_elapsed {
            return false;
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        true
    }
}

/// A handle on one scope's state, typed: values are the canonical JSON of `T`.
pub struct State<T> {
    raw: RawState,
    _type: PhantomData<fn() -> T>,
}

impl<T> Clone for State<T> {
    fn clone(&self) -> Self {
        State { raw: self.raw.clone(), _type: PhantomData }
    }
}

impl<T> fmt::Debug for State<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("State").field(&self.raw).finish()
    }
}

impl<T: Serialize + DeserializeOwned> State<T> {
    /// A handle on `scope`'s state in `store`, with the default [`UpdatePolicy`].
    pub fn new(store: impl IntoSharedStateStore, scope: Scope) -> State<T> {
        State { raw: RawState::new(store, scope), _type: PhantomData }
    }

    /// The same handle with `policy` for its updates.
    pub fn with_policy(self, policy: UpdatePolicy) -> State<T> {
        State { raw: self.raw.with_policy(policy), _type: PhantomData }
    }

    /// The handle over bytes.
    pub fn raw(&self) -> &RawState {
        &self.raw
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        self.raw.scope()
    }

    /// The value and version.
    pub async fn load(&self) -> Result<Loaded<T>, Error> {
        let loaded = self.raw.load().await?;
        Ok(Loaded { value: loaded.value.map(|v| self.decode(&v)).transpose()?, version: loaded.version })
    }

    /// Commits `value` on `expected`, under the token [`CommitToken::for_update`] gives.
    pub async fn commit(&self, expected: Version, value: &T) -> Result<Commit<T>, Error> {
        self.commit_with_token(expected, value, &CommitToken::for_update(self.scope())).await
    }

    /// Commits `value` on `expected`, under `token`.
    pub async fn commit_with_token(
        &self,
        expected: Version,
        value: &T,
        token: &CommitToken,
    ) -> Result<Commit<T>, Error> {
        let bytes = self.encode(value)?;
        match self.raw.commit_with_token(expected, bytes, token).await? {
            Commit::Committed { version, replayed } => Ok(Commit::Committed { version, replayed }),
            Commit::Conflict { current } => Ok(Commit::Conflict {
                current: Loaded {
                    value: current.value.map(|v| self.decode(&v)).transpose()?,
                    version: current.version,
                },
            }),
        }
    }

    /// Loads the state, applies `reducer` to its value (`None` while absent) and commits the
    /// result on the version loaded; on a conflict, waits the policy's backoff and does it all
    /// again, within the policy's attempts and time ([`Error::Contention`] past them). A reducer
    /// that fails ends the update with [`Error::Reducer`], nothing committed. Transient store
    /// failures are retried within the same bounds: the commit token makes that safe.
    pub async fn update<E, F>(&self, reducer: F) -> Result<Updated<T>, Error>
    where
        F: FnMut(Option<T>) -> Result<T, E>,
        E: Into<BoxError>,
    {
        let (token, derived) = CommitToken::for_update_derived(self.scope());
        self.update_under(&token, derived, reducer).await
    }

    /// [`update`](Self::update) under `token`: a retry of the same logical update under the
    /// same token applies it at most once (see [`Error::CommitUnanswered`]).
    pub async fn update_with_token<E, F>(&self, token: &CommitToken, reducer: F) -> Result<Updated<T>, Error>
    where
        F: FnMut(Option<T>) -> Result<T, E>,
        E: Into<BoxError>,
    {
        self.update_under(token, true, reducer).await
    }

    async fn update_under<E, F>(&self, token: &CommitToken, derived: bool, mut reducer: F) -> Result<Updated<T>, Error>
    where
        F: FnMut(Option<T>) -> Result<T, E>,
        E: Into<BoxError>,
    {
        // The reducer's error, or a decode/encode error (kept apart so that it is not reported as
        // the reducer's).
        let mut codec_error: Option<Error> = None;
        let res = self
            .raw
            .update_under(token, derived, |bytes| {
                let current = match bytes.map(|b| self.decode(b)).transpose() {
                    Ok(current) => current,
                    Err(e) => {
                        codec_error = Some(e);
                        return Err(BoxError::from("codec"));
                    }
                };
                let new = reducer(current).map_err(Into::into)?;
                self.encode(&new).map_err(|e| {
                    codec_error = Some(e);
                    BoxError::from("codec")
                })
            })
            .await;
        match res {
            Ok(updated) => Ok(Updated {
                value: self.decode(&updated.value)?,
                version: updated.version,
                attempts: updated.attempts,
                replayed: updated.replayed,
            }),
            Err(Error::Reducer { .. }) if codec_error.is_some() => Err(codec_error.unwrap_or_else(|| unreachable!())),
            Err(e) => Err(e),
        }
    }

    /// [`update`](Self::update) with an infallible change made in place (on `T::default()`
    /// while the state is absent).
    pub async fn modify<F>(&self, mut change: F) -> Result<Updated<T>, Error>
    where
        T: Default,
        F: FnMut(&mut T),
    {
        self.update(|current: Option<T>| {
            let mut value = current.unwrap_or_default();
            change(&mut value);
            Ok::<_, std::convert::Infallible>(value)
        })
        .await
    }

    fn encode(&self, value: &T) -> Result<Bytes, Error> {
        crate::canonical::to_canonical_vec(value).map(Bytes::from).map_err(|e| Error::StateValue {
            scope: self.scope().to_string(),
            detail: format!("the value has no canonical JSON form ({e}); nothing was committed"),
        })
    }

    fn decode(&self, bytes: &[u8]) -> Result<T, Error> {
        serde_json::from_slice(bytes).map_err(|e| Error::StateValue {
            scope: self.scope().to_string(),
            detail: format!(
                "the stored value does not decode into {} ({e}); if the type changed, migrate the state or use \
                 a new scope name",
                std::any::type_name::<T>()
            ),
        })
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

    #[test]
    fn scopes_differ_by_tenant_and_tokens_by_attempt_order() {
        assert_ne!(Scope::new("a").digest(), Scope::new("a").tenant("t").digest());
        assert_ne!(Scope::new("a").tenant("t").digest(), Scope::new("a").tenant("u").digest());
        assert_eq!(Scope::new("a").tenant("t").to_string(), "t/a");
        let key = crate::Key::from_bytes([7; 32]);
        let (a, b) = (crate::Attempt::new(key, 1, 1, false), crate::Attempt::new(key, 2, 2, true));
        let s = Scope::new("s");
        let (a0, a1) = (CommitToken::of_attempt(&a, &s), CommitToken::of_attempt(&a, &s));
        assert_ne!(a0, a1, "two updates of one action get two tokens");
        assert_eq!(CommitToken::of_attempt(&b, &s), a0, "a later attempt's first update has the first's token");
        assert_eq!(CommitToken::of_attempt(&b.clone(), &s), a1, "clones share the count");
        assert_eq!(CommitToken::derive("x"), CommitToken::derive("x"));
        assert_ne!(CommitToken::random(), CommitToken::random());
    }
}
