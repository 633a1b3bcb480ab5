//! What the SQL stores share: writing a step's outcome inside a transaction that also holds the
//! step's own writes, so that both commit together or not at all; and, inside the crate, how an
//! acquire's row is judged and how a dropped acquire finishes.
//!
//! [`SqliteStore`](super::SqliteStore) and [`PostgresStore`](super::PostgresStore) implement
//! [`TransactionalStore`]; `Step::run_in_transaction` drives it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;

use super::{BoxFuture, SharedStore, Store};
use crate::attempt::Attempt;
use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::lease::FinishOnDrop;
use crate::record::{Acquire, Grant, KEEP_RESOLVED_RELEASE, Resolution, Token, Transition};

/// A store whose records live in a SQL database, so that a step's completion can be written in
/// the transaction that holds the step's business writes.
///
/// The acquisition is committed on its own before (so that a concurrent duplicate sees the
/// operation in flight); the completion is one statement inside the caller's transaction, which
/// the caller then commits. Commit both, or neither.
pub trait TransactionalStore: Store + Clone {
    /// The sqlx database the records live in.
    type Database: sqlx::Database;

    /// Begins a transaction on the store's pool (on SQLite, `BEGIN IMMEDIATE`: the write lock is
    /// taken at once, so the transaction cannot fail later for want of it; on PostgreSQL,
    /// `BEGIN` at the database's default isolation, with the `statement_timeout` of the store's
    /// connections).
    fn begin(&self) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self::Database>, Error>>;

    /// The statement of [`Store::complete`], run inside `tx` and not committed: marks the key
    /// done with `result` if `token` still owns it ([`Transition::Ok`]), or changes nothing
    /// ([`Transition::LeaseLost`]). On PostgreSQL the record's row stays locked until `tx`
    /// ends: an acquire that would take the key over waits for the commit, then finds it done.
    fn complete_in<'a>(
        &'a self,
        tx: &'a mut sqlx::Transaction<'static, Self::Database>,
        key: &'a Key,
        token: &'a Token,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Transition, Error>>;

    /// Whether the lease is renewed (from another connection) while the transaction is open.
    ///
    /// `false` for SQLite: an open write transaction holds the file's one write lock, so a
    /// renewal would wait for it, and no other attempt can take the key over meanwhile anyway.
    /// `true` for PostgreSQL: the transaction locks the record's row only from `complete_in` on,
    /// so the heartbeat renews the lease from another connection of the pool while the action
    /// runs (unless the pool has one connection only, which the transaction holds).
    fn renews_during_transaction(&self) -> bool;
}

/// The sqlx databases a step can commit with, each mapped to its store: lets
/// `run_in_transaction` find the store from the type of the transaction its action takes.
pub trait CommitsWith: sqlx::Database {
    /// The store whose records live in this database.
    type Store: TransactionalStore<Database = Self>;
}

/// Durations are clamped to 100 years, so that `now + d` stays within an `i64` of µs.
pub(crate) const MAX_US: i64 = 100 * 365 * 24 * 60 * 60 * 1_000_000;

/// The `expires_at` of a `needs_attention` row: never (it waits to be resolved, and the purge,
/// which deletes rows whose `expires_at` has passed, never reaches it).
pub(crate) const NEVER_US: i64 = i64::MAX;

/// A duration in µs, as the SQL stores bind it.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(MAX_US).min(MAX_US)
}

/// The argument a transition binds after the key and the token.
pub(crate) enum Arg {
    /// complete: the outcome and its retention.
    Result(Bytes, Duration),
    /// renew: the new lease.
    Lease(Duration),
}

/// What the resolve statement writes over a `needs_attention` row: its new state, its result, and
/// how long from now it is kept.
pub(crate) fn resolved_row(resolution: Resolution) -> (&'static str, Option<Bytes>, i64) {
    match resolution {
        Resolution::Done { outcome, retention } => ("done", Some(outcome), micros(retention)),
        Resolution::NotDone => ("released", None, micros(KEEP_RESOLVED_RELEASE)),
    }
}

/// The row an acquire statement returns, read out of the driver's row type.
pub(crate) struct Found {
    pub(crate) token: String,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) state: String,
    pub(crate) fence: i64,
    pub(crate) attempt: i64,
    pub(crate) recovered: bool,
    /// µs until the lease deadline (meaningful for a running record of another attempt).
    pub(crate) left_us: i64,
    pub(crate) result: Option<Vec<u8>>,
}

impl Found {
    /// Tells the outcome of an acquire by `token` with `fingerprint` from the row it returned:
    /// ours, the key was taken; another's, the row says replay, in flight, needs attention or
    /// mismatch.
    pub(crate) fn judge(self, key: &Key, fingerprint: &Fingerprint, token: &Token) -> Result<Acquire, Error> {
        let corrupt = |detail: String| Error::Corrupt { key: key.short(), detail };
        let fence = || u64::try_from(self.fence).map_err(|_| corrupt(format!("negative fence {}", self.fence)));
        let attempt =
            || u32::try_from(self.attempt).map_err(|_| corrupt(format!("attempt {} out of range", self.attempt)));
        if self.token == token.as_str() {
            let (fence, attempt) = (fence()?, attempt()?);
            return Ok(Acquire::Acquired(Grant {
                token: token.clone(),
                attempt: Attempt::new(*key, fence, attempt, self.recovered),
            }));
        }
        if self.fingerprint != fingerprint.as_bytes() {
            return Ok(Acquire::Mismatch);
        }
        match self.state.as_str() {
            "done" => {
                let result = self.result.ok_or_else(|| corrupt("a done record without a result".to_owned()))?;
                Ok(Acquire::Replay(Bytes::from(result)))
            }
            "running" => {
                Ok(Acquire::InFlight { retry_after: Duration::from_micros(self.left_us.max(0).unsigned_abs()) })
            }
            "needs_attention" => Ok(Acquire::NeedsAttention { attempt: attempt()?, fence: fence()? }),
            other => Err(corrupt(format!("the record is {other:?} and another attempt's, yet was not taken"))),
        }
    }
}

/// An acquire in flight. Dropped before it answered (a timeout around the step, a caller that
/// went away), it goes on in a task of its own: the statement may already be running on its
/// connection, and only once it has ended can the key it may have taken be released. The work
/// reads `abandoned` to know whether anyone will use what it took.
pub(crate) struct AcquireCall<F: Future + Send + 'static> {
    abandoned: Arc<AtomicBool>,
    work: FinishOnDrop<F>,
}

impl<F: Future + Send + 'static> AcquireCall<F> {
    /// Wraps `work`, which sees `abandoned` set once the call was dropped unanswered.
    pub(crate) fn new(abandoned: Arc<AtomicBool>, work: F) -> Self {
        AcquireCall { abandoned, work: FinishOnDrop::new(work) }
    }
}

impl<F: Future + Send + 'static> Future for AcquireCall<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        Pin::new(&mut self.work).poll(cx)
    }
}

impl<F: Future + Send + 'static> Drop for AcquireCall<F> {
    fn drop(&mut self) {
        // Runs before `work` is dropped (and handed to a task), so that the task sees the flag.
        self.abandoned.store(true, Ordering::Release);
    }
}

/// The store behind `store` if it is `DB`'s ([`CommitsWith::Store`]), for work that commits in
/// a transaction of `DB`.
pub(crate) fn store_of<DB: CommitsWith>(store: &SharedStore) -> Option<&DB::Store> {
    let any: &dyn std::any::Any = &**store;
    any.downcast_ref::<DB::Store>()
}

/// The [`Error::Config`] for a `store` that is not `DB`'s, naming both and what to do; the
/// message opens with `what` (the step).
pub(crate) fn wrong_store<DB: CommitsWith>(store: &SharedStore, what: &str) -> Error {
    let wanted = short_type_name::<DB::Store>();
    Error::Config(format!(
        "{what}: run_in_transaction with a transaction of {db} needs the run context's store to be a \
         {wanted}, the store whose records live in that database, but it is {found}; create the RunContext \
         with a {wanted} (itself, not a wrapper around it) on the database the step writes to, or run the \
         step with Step::run",
        db = short_type_name::<DB>(),
        found = store.describe(),
    ))
}

/// `SqliteStore` for `idempotent_core::store::sqlite::SqliteStore`.
fn short_type_name<T: ?Sized>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}
