//! [`HookedStore`]: a [`Store`] that delegates to another one, with any of its four transitions
//! replaced by a test's closure, to place a fault or an observation exactly where a test needs it.
//!
//! A hook receives the call (its arguments as public fields, which it may change) and decides
//! what to do: [`forward`](AcquireCall::forward) it to the inner store, before or after its own
//! work, or answer by itself. State the hooks share with the test lives in the wrapper
//! ([`HookedStore::with_state`]) and is reached from a hook through `call.store.state()`, for
//! as long as the call runs.
//!
//! ```
//! # use std::sync::Arc;
//! # use idempotent_core::{MemoryStore, SharedStore, record::Transition};
//! # use idempotent_tests::hooked::HookedStore;
//! // A store whose `complete` reports success whatever the inner store said.
//! let store: SharedStore = Arc::new(
//!     HookedStore::new(Arc::new(MemoryStore::new()))
//!         .describe_as(|inner| format!("lenient {inner}"))
//!         .on_complete(|call| {
//!             Box::pin(async move {
//!                 call.forward().await?;
//!                 Ok(Transition::Ok)
//!             })
//!         }),
//! );
//! assert_eq!(store.describe(), "lenient memory");
//! ```

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::record::{Abandon, Acquire, Labels, Resolution, Resolved, Token, Transition};
use idempotent_core::store::{BoxFuture, Cursor, Deleted, Filter, Page, RecordInfo};
use idempotent_core::{Error, Fingerprint, Key, SharedStore, Store};

type Describe = Box<dyn Fn(&str) -> String + Send + Sync>;
type AcquireHook<S> = Box<dyn for<'a> Fn(AcquireCall<'a, S>) -> BoxFuture<'a, Result<Acquire, Error>> + Send + Sync>;
type CompleteHook<S> =
    Box<dyn for<'a> Fn(CompleteCall<'a, S>) -> BoxFuture<'a, Result<Transition, Error>> + Send + Sync>;
type ReleaseHook<S> = Box<dyn for<'a> Fn(ReleaseCall<'a, S>) -> BoxFuture<'a, Result<Transition, Error>> + Send + Sync>;
type RenewHook<S> = Box<dyn for<'a> Fn(RenewCall<'a, S>) -> BoxFuture<'a, Result<Transition, Error>> + Send + Sync>;

/// A [`Store`] that forwards every call to an inner [`SharedStore`] unless a hook for that
/// transition is set, and carries test state `S` its hooks can read.
pub struct HookedStore<S = ()> {
    inner: SharedStore,
    state: S,
    describe: Option<Describe>,
    acquire: Option<AcquireHook<S>>,
    complete: Option<CompleteHook<S>>,
    release: Option<ReleaseHook<S>>,
    renew: Option<RenewHook<S>>,
}

impl HookedStore {
    /// Wraps `inner` with no hooks and no state: until a hook is set, it behaves as `inner`.
    pub fn new(inner: SharedStore) -> Self {
        Self::with_state(inner, ())
    }
}

impl<S: Send + Sync + 'static> HookedStore<S> {
    /// Wraps `inner` with no hooks, keeping `state` for the hooks (and the test) to read.
    pub fn with_state(inner: SharedStore, state: S) -> Self {
        HookedStore { inner, state, describe: None, acquire: None, complete: None, release: None, renew: None }
    }

    /// The state given to [`with_state`](Self::with_state).
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The wrapped store.
    pub fn inner(&self) -> &SharedStore {
        &self.inner
    }

    /// Makes [`Store::describe`] answer `f(inner's description)` instead of the inner store's
    /// description.
    pub fn describe_as(mut self, f: impl Fn(&str) -> String + Send + Sync + 'static) -> Self {
        self.describe = Some(Box::new(f));
        self
    }

    /// Replaces [`Store::acquire`] with `hook`.
    pub fn on_acquire(
        mut self,
        hook: impl for<'a> Fn(AcquireCall<'a, S>) -> BoxFuture<'a, Result<Acquire, Error>> + Send + Sync + 'static,
    ) -> Self {
        self.acquire = Some(Box::new(hook));
        self
    }

    /// Replaces [`Store::complete`] with `hook`.
    pub fn on_complete(
        mut self,
        hook: impl for<'a> Fn(CompleteCall<'a, S>) -> BoxFuture<'a, Result<Transition, Error>> + Send + Sync + 'static,
    ) -> Self {
        self.complete = Some(Box::new(hook));
        self
    }

    /// Replaces [`Store::release`] with `hook`.
    pub fn on_release(
        mut self,
        hook: impl for<'a> Fn(ReleaseCall<'a, S>) -> BoxFuture<'a, Result<Transition, Error>> + Send + Sync + 'static,
    ) -> Self {
        self.release = Some(Box::new(hook));
        self
    }

    /// Replaces [`Store::renew`] with `hook`.
    pub fn on_renew(
        mut self,
        hook: impl for<'a> Fn(RenewCall<'a, S>) -> BoxFuture<'a, Result<Transition, Error>> + Send + Sync + 'static,
    ) -> Self {
        self.renew = Some(Box::new(hook));
        self
    }
}

/// A call to [`Store::acquire`] on a [`HookedStore`], as its hook receives it.
pub struct AcquireCall<'a, S> {
    /// The wrapper the call was made on (for its [`state`](HookedStore::state) and description).
    pub store: &'a HookedStore<S>,
    /// The key to acquire.
    pub key: &'a Key,
    /// The operation's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The lease asked for.
    pub lease: Duration,
    /// The retention asked for.
    pub retention: Duration,
    /// The record's labels.
    pub labels: Labels<'a>,
}

impl<'a, S> AcquireCall<'a, S> {
    /// Makes the call, with these arguments, on the inner store.
    pub fn forward(self) -> BoxFuture<'a, Result<Acquire, Error>> {
        self.store.inner.acquire_labeled(self.key, self.fingerprint, self.lease, self.retention, self.labels)
    }
}

/// A call to [`Store::complete`] on a [`HookedStore`], as its hook receives it.
pub struct CompleteCall<'a, S> {
    /// The wrapper the call was made on (for its [`state`](HookedStore::state) and description).
    pub store: &'a HookedStore<S>,
    /// The key to complete.
    pub key: &'a Key,
    /// The caller's token.
    pub token: &'a Token,
    /// The outcome to store.
    pub result: Bytes,
    /// The retention asked for.
    pub retention: Duration,
}

impl<'a, S> CompleteCall<'a, S> {
    /// Makes the call, with these arguments, on the inner store.
    pub fn forward(self) -> BoxFuture<'a, Result<Transition, Error>> {
        self.store.inner.complete(self.key, self.token, self.result, self.retention)
    }
}

/// A call to [`Store::release`] on a [`HookedStore`], as its hook receives it.
pub struct ReleaseCall<'a, S> {
    /// The wrapper the call was made on (for its [`state`](HookedStore::state) and description).
    pub store: &'a HookedStore<S>,
    /// The key to release.
    pub key: &'a Key,
    /// The caller's token.
    pub token: &'a Token,
}

impl<'a, S> ReleaseCall<'a, S> {
    /// Makes the call, with these arguments, on the inner store.
    pub fn forward(self) -> BoxFuture<'a, Result<Transition, Error>> {
        self.store.inner.release(self.key, self.token)
    }
}

/// A call to [`Store::renew`] on a [`HookedStore`], as its hook receives it.
pub struct RenewCall<'a, S> {
    /// The wrapper the call was made on (for its [`state`](HookedStore::state) and description).
    pub store: &'a HookedStore<S>,
    /// The key whose lease to renew.
    pub key: &'a Key,
    /// The caller's token.
    pub token: &'a Token,
    /// The new lease, from now.
    pub lease: Duration,
}

impl<'a, S> RenewCall<'a, S> {
    /// Makes the call, with these arguments, on the inner store.
    pub fn forward(self) -> BoxFuture<'a, Result<Transition, Error>> {
        self.store.inner.renew(self.key, self.token, self.lease)
    }
}

impl<S: Send + Sync + 'static> Store for HookedStore<S> {
    fn acquire_labeled<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: Labels<'a>,
    ) -> BoxFuture<'a, Result<Acquire, Error>> {
        let call = AcquireCall { store: self, key, fingerprint, lease, retention, labels };
        match &self.acquire {
            Some(hook) => hook(call),
            None => call.forward(),
        }
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let call = CompleteCall { store: self, key, token, result, retention };
        match &self.complete {
            Some(hook) => hook(call),
            None => call.forward(),
        }
    }

    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<Transition, Error>> {
        let call = ReleaseCall { store: self, key, token };
        match &self.release {
            Some(hook) => hook(call),
            None => call.forward(),
        }
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        let call = RenewCall { store: self, key, token, lease };
        match &self.renew {
            Some(hook) => hook(call),
            None => call.forward(),
        }
    }

    /// Always forwarded (no hook).
    fn abandon<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        mark: Abandon,
    ) -> BoxFuture<'a, Result<Transition, Error>> {
        self.inner.abandon(key, token, mark)
    }

    /// Always forwarded (no hook).
    fn resolve<'a>(&'a self, key: &'a Key, resolution: Resolution) -> BoxFuture<'a, Result<Resolved, Error>> {
        self.inner.resolve(key, resolution)
    }

    fn describe(&self) -> String {
        match &self.describe {
            Some(f) => f(&self.inner.describe()),
            None => self.inner.describe(),
        }
    }

    /// Always forwarded (no hook).
    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<RecordInfo>, Error>> {
        self.inner.inspect(key)
    }

    /// Always forwarded (no hook).
    fn scan<'a>(&'a self, filter: &'a Filter, cursor: &'a Cursor, limit: usize) -> BoxFuture<'a, Result<Page, Error>> {
        self.inner.scan(filter, cursor, limit)
    }

    /// Always forwarded (no hook).
    fn release_fenced<'a>(&'a self, key: &'a Key, fence: u64) -> BoxFuture<'a, Result<Resolved, Error>> {
        self.inner.release_fenced(key, fence)
    }

    /// Always forwarded (no hook).
    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Deleted, Error>> {
        self.inner.delete(key)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}
