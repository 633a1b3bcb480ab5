//! [`RawState`]: a handle on one scope's state over bytes, and the update loop (load, reduce,
//! commit, again on a conflict) that [`State`] also runs.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use crate::backoff::Backoff;
use crate::error::{BoxError, Error};

#[cfg(doc)]
use super::State;
use super::{Commit, CommitToken, IntoSharedStateStore, Loaded, Scope, SharedStateStore, Version};

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
    pub fn policy(mut self, policy: UpdatePolicy) -> RawState {
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
    pub(super) async fn update_under<E, F>(
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
                                key: crate::Key::from_bytes(*scope.digest()).short().to_string(),
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
