//! [`State`]: a handle on one scope's state, typed.

use std::fmt;
use std::marker::PhantomData;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{BoxError, Error};

use super::{Commit, CommitToken, IntoSharedStateStore, Loaded, RawState, Scope, UpdatePolicy, Updated, Version};

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
    pub fn policy(self, policy: UpdatePolicy) -> State<T> {
        State { raw: self.raw.policy(policy), _type: PhantomData }
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
