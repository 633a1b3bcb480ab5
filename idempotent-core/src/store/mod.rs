//! Where records live: the [`Store`] trait and its implementations.
//!
//! [`MemoryStore`] is the embedded default for one process and for tests. [`RedisStore`] (feature
//! `redis`) shares records between processes and machines, on standalone Redis or Redis Cluster.
//! [`SqliteStore`] (feature `sqlite`) keeps them in one SQLite file, durable across restarts and
//! shared by the processes of one host. [`PostgresStore`] (feature `postgres`) keeps them in a
//! PostgreSQL table, shared by every process that reaches the database. All pass the same
//! conformance suite (`tests/src/conformance.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;

use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::record::{Abandon, Acquire, Labels, Resolution, Resolved, Token, Transition};

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
mod acquire_order;
pub mod admin;
mod connect;
pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub mod sql;

#[cfg(feature = "redis")]
pub use self::redis::{Preflight, Problem, RedisStore, RedisStoreBuilder, Risk};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "redis"))]
pub(crate) use acquire_order::AcquireOrder;
pub use admin::{Cursor, Deleted, Filter, MAX_PAGE, Page, Purged, RecordInfo, RecordState, delete_all};
pub use connect::connect;
pub use memory::MemoryStore;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use sql::{CommitsWith, SqlStore, TransactionalStore};
#[cfg(feature = "postgres")]
pub use sql::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "sqlite")]
pub use sql::{SqliteStore, SqliteStoreBuilder};

/// The guard of `m`, also after a thread panicked holding it: every state these mutexes guard
/// is whole between two statements, so a panic leaves nothing half-written.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A boxed, sendable future, so that [`Store`] stays object safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A record store implementing the protocol of [`crate::record`].
///
/// Each method is one atomic transition. Implementations must judge leases by their own clock,
/// keep fencing tokens growing per key, and never hold a connection after the returned future
/// completes. The trait is object safe: the executor holds an `Arc<dyn Store>`, and can look
/// through it for the concrete store (`Any`), as `run_in_transaction` does for the SQL stores.
pub trait Store: std::any::Any + Send + Sync {
    /// Takes the key if it is free (absent, released, or its lease passed), or reports why not.
    ///
    /// `lease` bounds how long the caller may hold the key without renewing; `retention` is how
    /// long the record is kept (each transition's effect on that is in one table:
    /// [retention](crate::record#retention)). `labels` are written into the record when the key is
    /// taken (and read back by [`inspect`](Self::inspect) and [`scan`](Self::scan)).
    fn acquire_labeled<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
        labels: Labels<'a>,
    ) -> BoxFuture<'a, Result<Acquire, Error>>;

    /// [`acquire_labeled`](Self::acquire_labeled) with no labels: the record has an empty step
    /// name, no run and no tenant.
    fn acquire<'a>(
        &'a self,
        key: &'a Key,
        fingerprint: &'a Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Acquire, Error>> {
        self.acquire_labeled(key, fingerprint, lease, retention, Labels::default())
    }

    /// Stores the outcome and marks the operation done, if `token` still owns the key; it is kept
    /// for `retention` from now.
    ///
    /// Must be idempotent for the token: a repeat by the token that completed the key (a retry
    /// after a lost reply, or the executor finishing a call its caller dropped) answers
    /// [`Transition::Ok`] and changes nothing.
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>>;

    /// Gives the key up without an outcome (the fence is kept), if `token` still owns it.
    ///
    /// Idempotent for the token, as [`complete`](Self::complete) is.
    fn release<'a>(&'a self, key: &'a Key, token: &'a Token) -> BoxFuture<'a, Result<Transition, Error>>;

    /// Moves the lease deadline to `lease` from now, if `token` still owns the key.
    fn renew<'a>(&'a self, key: &'a Key, token: &'a Token, lease: Duration)
    -> BoxFuture<'a, Result<Transition, Error>>;

    /// Ends `token`'s attempt without an outcome, leaving the record as `mark` says (see
    /// [`Abandon`]), if `token` still owns the key.
    ///
    /// The fence and attempt number are kept. Idempotent for the token, as
    /// [`complete`](Self::complete) is: a repeat with the same `mark` answers
    /// [`Transition::Ok`]. A `needs_attention` record never expires.
    fn abandon<'a>(&'a self, key: &'a Key, token: &'a Token, mark: Abandon)
    -> BoxFuture<'a, Result<Transition, Error>>;

    /// Settles a `needs_attention` record as `resolution` says; any other record is left as it
    /// is ([`Resolved::Unchanged`]).
    fn resolve<'a>(&'a self, key: &'a Key, resolution: Resolution) -> BoxFuture<'a, Result<Resolved, Error>>;

    /// A short description for logs and errors (a URL without credentials, or `memory`).
    fn describe(&self) -> String;

    /// The record under `key`, if there is one (an expired record is none).
    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<RecordInfo>, Error>>;

    /// One page of the records that pass `filter`, from `cursor` ([`Cursor::start`] first),
    /// with at most `limit` records (at most [`MAX_PAGE`]) and a bounded amount of work (see
    /// [`admin`]).
    fn scan<'a>(&'a self, filter: &'a Filter, cursor: &'a Cursor, limit: usize) -> BoxFuture<'a, Result<Page, Error>>;

    /// Takes the key from whichever attempt holds it, if that attempt's fence is `fence`: the
    /// record is left as an uncertain release would leave it ([`RecordState::Stuck`]: no
    /// outcome, and the next acquisition is [`recovered`](crate::Attempt::recovered)), whether
    /// the lease is live or ran out. The attempt that held it can no longer complete, renew or
    /// release it.
    ///
    /// For an operator freeing a lease whose holder is known to be gone. Any other record
    /// (absent, another fence, not running) is left as it is ([`Resolved::Unchanged`]).
    fn release_fenced<'a>(&'a self, key: &'a Key, fence: u64) -> BoxFuture<'a, Result<Resolved, Error>>;

    /// Removes the record, unless an attempt holds a live lease on it ([`Deleted::Running`]).
    ///
    /// The next call of the operation runs it as a new one (attempt 1, not recovered); fences
    /// still grow past every fence the record had.
    fn delete<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Deleted, Error>>;

    /// A short, fixed name of the kind of store (`memory`, `redis`, `sqlite`, `postgres`): the
    /// `store` label of the [metrics](crate::metrics). `custom` unless the store says otherwise.
    fn kind(&self) -> &'static str {
        "custom"
    }
}

/// A shared, type-erased store handle.
pub type SharedStore = Arc<dyn Store>;

/// Turns a concrete store (or an existing handle) into a [`SharedStore`] without double boxing.
pub trait IntoSharedStore {
    /// Performs the conversion.
    fn into_shared(self) -> SharedStore;
}

impl<S: Store> IntoSharedStore for S {
    fn into_shared(self) -> SharedStore {
        Arc::new(self)
    }
}

impl IntoSharedStore for SharedStore {
    fn into_shared(self) -> SharedStore {
        self
    }
}
